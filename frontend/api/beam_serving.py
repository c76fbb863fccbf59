"""/v1/completions with use_beam_search (vLLM's field): the engine's beam search (frontend.beam_search) step by step
over the gateway's engine client, each step's live beams one batch of one-token requests; n beams per prompt."""
from __future__ import annotations

import time

import msgspec

from frontend.api.choices import PromptChoices, RequestObservers, final_outputs
from frontend.api.errors import APIError
from frontend.api.protocol import CompletionRequest
from frontend.api.responses import CompletionChoice
from frontend.async_llm import AsyncLLM
from frontend.beam_search import BeamSearch, BeamSearchParams, live_beams, take_step
from ipc import RequestOutputKind


async def beam_search_choices(engine: AsyncLLM, body: CompletionRequest, prompts: list[PromptChoices],
                              request_id: str, observers: RequestObservers) -> list[CompletionChoice]:
    """Each prompt's n best beams as its choices, best first, their token counts in `prompts` (400 for what beam
    search does not return)."""
    for field, asked in (("stream", body.stream), ("logprobs", body.logprobs is not None), ("echo", body.echo),
                         ("prompt_logprobs", body.prompt_logprobs is not None)):
        if asked:
            raise APIError(400, f"{field} is not available with use_beam_search", field)
    start = time.monotonic()
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=body.max_tokens, length_penalty=body.length_penalty,
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
    choices, reasons = [], []
    for prompt, search in zip(prompts, searches):
        sequences = search.output(engine.tokenizer).sequences
        prompt.num_completion_tokens = sum(len(s.tokens) - prompt.num_prompt_tokens for s in sequences)
        for sequence in sequences:
            choices.append(CompletionChoice(index=len(choices), text=sequence.text,
                                            finish_reason=sequence.finish_reason))
            reasons.append(sequence.finish_reason)
    observers.request_ended(request_id, prompts, reasons, time.monotonic() - start, [c.text for c in choices])
    return choices
