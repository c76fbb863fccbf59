"""/v1/completions, /v1/chat/completions and /tokenize: requests to engine choices, outputs to JSON or SSE chunks."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi.responses import JSONResponse

from frontend.api.choices import Choice, StreamedChoices, final_outputs
from frontend.api.errors import APIError
from frontend.api.logprobs import chat_logprobs, completion_logprobs
from frontend.api.metrics import ServerMetrics
from frontend.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TokenizeRequest,
    UsageInfo,
)
from frontend.api.sampling import ServerLimits, check_limits, sampling_params
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput
from frontend.parallel_sampling import child_params
from frontend.tokenizer import apply_chat_template, encode


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.limits, self.metrics = engine, model_name, limits, metrics

    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        prompt_list = _prompt_list(body.prompt)
        check_limits(body, self.limits, len(prompt_list))
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        prompts = [self._completion_prompt(p) for p in prompt_list]
        choices = self._choices(body, prompts)
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        if body.stream:
            # Plain dicts on the per-token path: a pydantic model per chunk costs more than the rest of the chunk.
            head = CompletionResponse(model=self.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
            return await StreamedChoices(self.engine, choices, uuid.uuid4().hex, self.metrics,
                                         _completion_chunk(head, body, len(choices)),
                                         _usage_chunks(head, body, num_prompt_tokens, choices)).open()
        finals = await final_outputs(self.engine, choices, uuid.uuid4().hex, self.metrics)
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
        text = self._chat_text(body.messages, body.add_generation_prompt)
        prompt = {"prompt": text, "prompt_token_ids": self._encode(text, "messages", add_special_tokens=False)}
        choices = self._choices(body, [prompt])
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        if body.stream:
            head = ChatCompletionChunk(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                       model=self.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
            role_chunks = [{**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], "usage": None}
                           for index in range(len(choices))]
            return await StreamedChoices(self.engine, choices, uuid.uuid4().hex, self.metrics, _chat_chunk(head, body),
                                         _usage_chunks(head, body, num_prompt_tokens, choices), role_chunks).open()
        finals = await final_outputs(self.engine, choices, uuid.uuid4().hex, self.metrics)
        response = ChatCompletionResponse(model=self.model_name, usage=_usage(num_prompt_tokens, choices), choices=[
            ChatChoice(index=i, message=ChatResponseMessage(content=c.text),
                       logprobs=chat_logprobs(c, body.top_logprobs or 0), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason) for i, c in enumerate(finals)])
        return JSONResponse(response.model_dump())

    def tokenize(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            tokens = self._encode(body.prompt, "prompt", body.add_special_tokens)
        else:
            tokens = self._encode(self._chat_text(body.messages, True), "messages", add_special_tokens=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_model_len}

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {self.model_name!r}", "model",
                           "model_not_found")

    def _completion_prompt(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            return {"prompt": prompt, "prompt_token_ids": self._encode(prompt, "prompt")}
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return {"prompt_token_ids": prompt}

    def _chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        """The conversation as prompt text, through the model's chat template."""
        dicts = [{"role": m.role, "content": _message_text(m.content)} for m in messages]
        try:
            return apply_chat_template(self.engine.tokenizer, dicts, self.model_name, add_generation_prompt)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return encode(self.engine.tokenizer, text, field, add_special_tokens)
        except ValueError as error:
            raise APIError(400, str(error), field) from error

    def _choices(self, body: SamplingFields, prompts: list[dict]) -> list[Choice]:
        choices = []
        for prompt in prompts:
            if body.cache_salt is not None:
                prompt = {**prompt, "cache_salt": body.cache_salt}
            params = sampling_params(body, len(prompt["prompt_token_ids"]), self.limits)
            choices += [Choice(prompt, child_params(params, i), len(prompt["prompt_token_ids"])) for i in range(body.n)]
        return choices


def _completion_chunk(head: dict, body: CompletionRequest, num_choices: int) -> Callable[[int, RequestOutput], dict]:
    """The function that turns one choice's delta output into a completions chunk."""
    text_offsets = [0] * num_choices
    num_top = body.logprobs or 0

    def chunk(index: int, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        logprobs = completion_logprobs(completion, num_top, text_offsets[index])
        text_offsets[index] += len(completion.text)
        return {**head, "choices": [{"index": index, "text": completion.text, "logprobs": logprobs,
                                     "finish_reason": completion.finish_reason,
                                     "stop_reason": completion.stop_reason}], "usage": None}
    return chunk


def _chat_chunk(head: dict, body: ChatCompletionRequest) -> Callable[[int, RequestOutput], dict]:
    """The function that turns one choice's delta output into a chat chunk."""
    num_top = body.top_logprobs or 0

    def chunk(index: int, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        return {**head, "choices": [{"index": index, "delta": {"content": completion.text},
                                     "logprobs": chat_logprobs(completion, num_top),
                                     "finish_reason": completion.finish_reason}], "usage": None}
    return chunk


def _usage_chunks(head: dict, body: SamplingFields, num_prompt_tokens: int,
                  choices: list[Choice]) -> Callable[[], list[dict]]:
    """The usage chunk a stream ends with when stream_options.include_usage asks for it."""
    def chunks() -> list[dict]:
        if not (body.stream_options and body.stream_options.include_usage):
            return []
        return [{**head, "choices": [], "usage": _usage(num_prompt_tokens, choices).model_dump()}]
    return chunks


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

