"""use_beam_search (vLLM's field) on /v1/completions and /v1/chat/completions: the engine's beam search
(frontend.beam_search) step by step over the gateway's engine client, each step's live beams one batch of one-token
requests; n beams per prompt."""
from __future__ import annotations

import time

import msgspec

from frontend.api.choices import PromptChoices, RequestObservers, final_outputs
from frontend.api.errors import APIError
from frontend.api.protocol import SamplingFields
from frontend.api.sampling import num_logprobs, requested_max_tokens
from frontend.async_llm import AsyncLLM
from frontend.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, live_beams, take_step
from ipc import RequestOutputKind

_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def refuse_beamless(body: SamplingFields) -> None:
    """A 400 naming the first field asked for that beam search does not return (stream, logprobs, echo...) or
    cannot honour (tools, an output constraint)."""
    asked = {"stream": body.stream, "logprobs": num_logprobs(body) is not None, "echo": getattr(body, "echo", False),
             "prompt_logprobs": body.prompt_logprobs is not None, "tools": bool(getattr(body, "tools", None)),
             "response_format": body.response_format is not None and body.response_format.type != "text",
             **{field: getattr(body, field) is not None for field in _CONSTRAINTS}}
    for field, given in asked.items():
        if given:
            raise APIError(400, f"{field} is not available with use_beam_search", field)


async def beam_search(engine: AsyncLLM, body: SamplingFields, prompts: list[PromptChoices], request_id: str,
                      observers: RequestObservers) -> list[BeamSearchSequence]:
    """Each prompt's n best beams, best first, prompt after prompt, their token counts in `prompts` (400 for
    parameters beam search refuses). Without max_tokens a beam may run to the end of the context."""
    start = time.monotonic()
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        max_tokens = min(engine.info.max_model_len - p.num_prompt_tokens for p in prompts)
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, length_penalty=body.length_penalty,
                                  early_stopping=body.early_stopping, ignore_eos=body.ignore_eos)
        searches = [BeamSearch(p.prompt["prompt_token_ids"], params, engine.tokenizer.eos_token_id, engine.info)
                    for p in prompts]
    except ValueError as error:
        field = str(error).split(" ", 1)[0].removeprefix("BeamSearchParams.")
        raise APIError(400, str(error), {"beam_width": "n", "eos_token_id": "prompt"}.get(field, field)) from None
    step_params = msgspec.structs.replace(params.step_sampling_params(), output_kind=RequestOutputKind.FINAL_ONLY)
    lora = prompts[0].lora_request
    step = 0
    while (beams := live_beams(searches))[0]:
        live, ids = beams
        outputs = await final_outputs(engine, [PromptChoices({"prompt_token_ids": i}, step_params, lora) for i in ids],
                                      f"{request_id}-beam-{step}", None)
        take_step(live, iter(outputs))
        step += 1
    found = []
    for prompt, search in zip(prompts, searches):
        sequences = search.output(engine.tokenizer).sequences
        prompt.num_completion_tokens = sum(len(s.tokens) - prompt.num_prompt_tokens for s in sequences)
        found += sequences
    observers.request_ended(request_id, prompts, [s.finish_reason for s in found], time.monotonic() - start,
                            [s.text for s in found])
    return found
