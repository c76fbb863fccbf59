"""/v1/completions and /v1/chat/completions: requests to engine choices, outputs to JSON or SSE chunks."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.api.choices import Choice, stream_choices
from frontend.api.errors import APIError, error_body
from frontend.api.logprobs import chat_logprobs, completion_logprobs
from frontend.api.metrics import ServerMetrics
from frontend.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    UsageInfo,
)
from frontend.api.sampling import ServerLimits, check_limits, sampling_params
from frontend.async_llm import AsyncLLM
from frontend.core_client import EngineDeadError, EngineOverloadedError
from frontend.outputs import CompletionOutput
from frontend.parallel_sampling import child_params
from frontend.tokenizer import apply_chat_template


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.limits, self.metrics = engine, model_name, limits, metrics

    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        check_limits(body, self.limits)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        prompts = [self._completion_prompt(p) for p in _prompt_list(body.prompt)]
        choices = self._choices(body, prompts)
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        stream = await _started(stream_choices(self.engine, choices, uuid.uuid4().hex, self.metrics))
        if body.stream:
            return _sse(self._completion_chunks(stream, body, choices, num_prompt_tokens))
        finals = await _collect(stream, len(choices))
        response = CompletionResponse(model=self.model_name, usage=_usage(num_prompt_tokens, choices), choices=[
            CompletionChoice(index=i, text=c.text, logprobs=completion_logprobs(c, body.logprobs or 0, 0),
                             finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for i, c in enumerate(finals)])
        return JSONResponse(response.model_dump())

    async def chat(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        check_limits(body, self.limits)
        if body.chat_template is not None:
            raise APIError(400, "chat_template is not accepted: the server uses the model's own template",
                           "chat_template")
        prompt = self._chat_prompt(body)
        choices = self._choices(body, [prompt])
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        stream = await _started(stream_choices(self.engine, choices, uuid.uuid4().hex, self.metrics))
        if body.stream:
            return _sse(self._chat_chunks(stream, body, choices, num_prompt_tokens))
        finals = await _collect(stream, len(choices))
        response = ChatCompletionResponse(model=self.model_name, usage=_usage(num_prompt_tokens, choices), choices=[
            ChatChoice(index=i, message=ChatResponseMessage(content=c.text),
                       logprobs=chat_logprobs(c, body.top_logprobs or 0), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason) for i, c in enumerate(finals)])
        return JSONResponse(response.model_dump())

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {self.model_name!r}", "model",
                           "model_not_found")

    def _completion_prompt(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            return {"prompt": prompt, "prompt_token_ids": self.engine.tokenizer.encode(prompt)}
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return {"prompt_token_ids": prompt}

    def _chat_prompt(self, body: ChatCompletionRequest) -> dict:
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        try:
            text = apply_chat_template(self.engine.tokenizer, messages, self.model_name, body.add_generation_prompt)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        return {"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}

    def _choices(self, body: SamplingFields, prompts: list[dict]) -> list[Choice]:
        choices = []
        for prompt in prompts:
            if body.cache_salt is not None:
                prompt = {**prompt, "cache_salt": body.cache_salt}
            params = sampling_params(body, len(prompt["prompt_token_ids"]), self.limits)
            choices += [Choice(prompt, child_params(params, i), len(prompt["prompt_token_ids"])) for i in range(body.n)]
        return choices

    async def _completion_chunks(self, stream, body: CompletionRequest, choices: list[Choice],
                                 num_prompt_tokens: int) -> AsyncIterator[dict]:
        # Plain dicts on the per-token path: a pydantic model per chunk costs more than the rest of the chunk.
        head = CompletionResponse(model=self.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
        text_offsets = [0] * len(choices)
        async for index, output in stream:
            completion = output.outputs[0]
            logprobs = completion_logprobs(completion, body.logprobs or 0, text_offsets[index])
            text_offsets[index] += len(completion.text)
            yield {**head, "choices": [{"index": index, "text": completion.text, "logprobs": logprobs,
                                        "finish_reason": completion.finish_reason,
                                        "stop_reason": completion.stop_reason}], "usage": None}
        if body.stream_options and body.stream_options.include_usage:
            yield {**head, "choices": [], "usage": _usage(num_prompt_tokens, choices).model_dump()}

    async def _chat_chunks(self, stream, body: ChatCompletionRequest, choices: list[Choice],
                           num_prompt_tokens: int) -> AsyncIterator[dict]:
        head = ChatCompletionChunk(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                   model=self.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
        for index in range(len(choices)):
            yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], "usage": None}
        async for index, output in stream:
            completion = output.outputs[0]
            yield {**head, "choices": [{"index": index, "delta": {"content": completion.text},
                                        "logprobs": chat_logprobs(completion, body.top_logprobs or 0),
                                        "finish_reason": completion.finish_reason}], "usage": None}
        if body.stream_options and body.stream_options.include_usage:
            yield {**head, "choices": [], "usage": _usage(num_prompt_tokens, choices).model_dump()}


def api_error_from(error: Exception) -> APIError | None:
    """The HTTP error an engine-side failure maps to (None: not one of ours, a bug)."""
    if isinstance(error, EngineOverloadedError):
        return APIError(429, str(error), code="overloaded")
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is not available: {error}", code="engine_dead")
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    return None


async def _started(stream: AsyncIterator) -> AsyncIterator:
    """Wait for the first output before answering, so a refused request (full queue, bad input) gets its status
    code instead of a 200 stream that fails."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except Exception as error:
        await stream.aclose()
        mapped = api_error_from(error)
        raise mapped if mapped is not None else error

    async def resumed():
        try:
            if first is not None:
                yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
    return resumed()


async def _collect(stream: AsyncIterator, num_choices: int) -> list[CompletionOutput]:
    """Each choice's final output (a response that is not streamed asks for FINAL_ONLY outputs)."""
    finals: list[CompletionOutput | None] = [None] * num_choices
    try:
        async for index, output in stream:
            finals[index] = output.outputs[0]
    except Exception as error:
        mapped = api_error_from(error)
        raise mapped if mapped is not None else error
    return finals


_json = msgspec.json.Encoder()  # several times faster than json.dumps on the per-token path


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield b"data: " + _json.encode(chunk) + b"\n\n"
        except Exception as error:  # headers are sent: the error goes in the stream, as OpenAI does
            mapped = api_error_from(error) or APIError(500, f"internal error: {type(error).__name__}")
            body = error_body(mapped.status, mapped.message, mapped.param, mapped.code)
            yield b"data: " + _json.encode(body) + b"\n\n"
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _usage(num_prompt_tokens: int, choices: list[Choice]) -> UsageInfo:
    completion = sum(c.num_completion_tokens for c in choices)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    return list(prompt)


def _message_text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "messages")
        parts.append(part["text"])
    return "\n".join(parts)

