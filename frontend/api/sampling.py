"""From an OpenAI request to SamplingParams, with the server's own limits checked (n, stop strings, choices)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from frontend.api.errors import APIError
from frontend.api.protocol import ChatCompletionRequest, ResponseFormat, SamplingFields
from frontend.api.tools import tool_constraint, tool_mode
from frontend.generation_config import apply_generation_defaults
from frontend.tokenizer import check_text
from ipc import RequestOutputKind, SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class ServerLimits:
    max_model_len: int
    max_n: int = 16
    max_stop: int = 16
    # Prompts x n of one request: each choice is an engine request, made (and its prompt tokenized) before any
    # runs. The default matches the engine's default --max-waiting-requests: a request with more would end in 429.
    max_choices_per_request: int = 1024


def sampling_params(request: SamplingFields, limits: ServerLimits, defaults: Mapping[str, float | int] | None = None,
                    tool_parser: str | None = None) -> SamplingParams:
    """The request's params, shared by its prompts (each prompt's n choices are one request group); `defaults`
    (the model's generation config) fill what the request leaves out. The engine's rules (context length,
    logprobs, token ids) are checked when each prompt is sent: frontend.prompts."""
    fields = dict(max_tokens=requested_max_tokens(request), temperature=request.temperature, top_p=request.top_p,
                  top_k=request.top_k, min_p=request.min_p,
                  presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                  repetition_penalty=request.repetition_penalty,
                  stop=request.stop, stop_token_ids=request.stop_token_ids, min_tokens=request.min_tokens,
                  ignore_eos=request.ignore_eos, skip_special_tokens=request.skip_special_tokens,
                  include_stop_str_in_output=request.include_stop_str_in_output, bad_words=request.bad_words,
                  logprobs=num_logprobs(request), logit_bias=_logit_bias(request.logit_bias),
                  prompt_logprobs=_prompt_logprobs(request))
    fields = apply_generation_defaults(fields, defaults or {})
    max_tokens = fields.pop("max_tokens")  # None: whatever room the prompt leaves in the context
    fields = {name: value for name, value in fields.items() if value is not None}
    try:
        # A response that is not streamed needs only the end: no per-step outputs to build in the gateway.
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(n=request.n, max_tokens=max_tokens, seed=request.seed, output_kind=kind,
                              structured_outputs=structured_outputs(request, tool_parser), **fields)
    except ValueError as error:
        param = str(error).removeprefix("SamplingParams.").split(" ", 1)[0]
        raise APIError(400, str(error).removeprefix("SamplingParams."), param) from error


def structured_outputs(request: SamplingFields, tool_parser: str | None = None) -> StructuredOutputsParams | None:
    """The one constraint a request may carry, from whichever field carries it (a 400 if two do)."""
    given = {"response_format": _response_format(request.response_format),
             "structured_outputs": request.structured_outputs}
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        given[f"guided_{kind}"] = None if value is None else {kind: value}
    # "auto" only keeps calls valid: an answer format the client gives wins over it
    if _is_chat(request) and (mode := tool_mode(request, tool_parser)) is not None and (
            mode != "auto" or all(fields is None for fields in given.values())):
        given["tool_choice"] = tool_constraint(request, mode, tool_parser)
    given = {name: fields for name, fields in given.items() if fields is not None}
    if len(given) > 1:
        raise APIError(400, f"one output constraint at a time: got {', '.join(given)}", list(given)[1])
    if not given:
        return None
    [(name, fields)] = given.items()
    try:
        if isinstance(fields, StructuredOutputsParams):
            return fields
        return msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as error:
        raise APIError(400, f"{name}: {error}", name) from None


def _response_format(response_format: ResponseFormat | None) -> dict | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "structural_tag":
        return {"structural_tag": json.dumps(structural_tag(response_format), ensure_ascii=False)}
    return {"json": response_format.json_schema.schema_}


def structural_tag(response_format: ResponseFormat) -> dict:
    """xgrammar's structural tag of a response_format of that type: its `format`, or the older `structures` (each
    a begin string, a JSON schema and an end string, allowed after any of the `triggers`) as the tags that format
    names."""
    if response_format.format is not None:
        return {"type": "structural_tag", "format": response_format.format}
    if response_format.structures is None:
        raise APIError(400, 'a structural_tag response_format needs "format" (or "structures" and "triggers")',
                       "response_format")
    tags = [{"begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
             "end": s.get("end")} for s in response_format.structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": response_format.triggers or [],
                                                 "tags": tags}}


def check_limits(request: SamplingFields, limits: ServerLimits, num_prompts: int = 1) -> None:
    """The server's limits on a request's shape; cheap, so they run before any prompt is tokenized."""
    if not 1 <= request.n <= limits.max_n:
        raise APIError(400, f"n must be between 1 and {limits.max_n}, got {request.n}", "n")
    if num_prompts * request.n > limits.max_choices_per_request:
        raise APIError(400, f"{num_prompts} prompts x n={request.n} is {num_prompts * request.n} choices, over this "
                            f"server's limit of {limits.max_choices_per_request} per request "
                            "(--max-choices-per-request); split the request", "n")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > limits.max_stop:
        raise APIError(400, f"at most {limits.max_stop} stop strings, got {len(stops)}", "stop")
    try:
        for stop in stops:
            check_text(stop, "stop")
    except ValueError as error:
        raise APIError(400, str(error), "stop") from None
    if _is_chat(request) and request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if request.stream and request.prompt_logprobs is not None:  # vLLM's rule too: they come with the whole answer
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _prompt_logprobs(request: SamplingFields) -> int | None:
    """The prompt's best N per token: as asked (prompt_logprobs), or an echoed prompt's completions logprobs."""
    asked = [n for n in (request.prompt_logprobs, request.logprobs if getattr(request, "echo", False) else None)
             if n is not None]
    return max(asked) if asked else None


def num_logprobs(request: SamplingFields) -> int | None:
    """Top alternatives per token: chat's top_logprobs (with logprobs: true), completions' logprobs."""
    if _is_chat(request):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


def requested_max_tokens(request: SamplingFields) -> int | None:
    """The max_tokens the client asked for (None: left out)."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def _is_chat(request: SamplingFields) -> bool:
    return isinstance(request, ChatCompletionRequest)

