"""/v1/completions, /v1/chat/completions (the chat path /v1/responses and /v1/messages take too) and /tokenize:
requests to engine choices, outputs to JSON or SSE chunks."""
from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Mapping

import msgspec
from fastapi.responses import JSONResponse, Response

from frontend.api.beam_serving import beam_search, refuse_beamless
from frontend.api.chat_chunks import ToolReader, chat_chunks
from frontend.api.chat_media import chat_images, image_urls, images_for_prompt
from frontend.api.choices import (ChunkWriter, OpenAIChunks, PromptChoices, RequestObservers, StreamedChoices,
                                  final_outputs)
from frontend.api.errors import APIError
from frontend.api.lora_adapters import LoRAAdapters
from frontend.api.logprobs import (chat_logprobs, completion_logprobs, join_logprobs, prompt_logprobs,
                                   prompt_logprobs_body)
from frontend.api.media import MediaOptions
from frontend.api.prompt_embeds import embeds_list, read_prompt_embeds
from frontend.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, TokenizeRequest
from frontend.api.reasoning_parsers import (
    REASONING_PARSERS,
    reasoning_section,
    section_start,
    split_reasoning,
)
from frontend.api.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from frontend.api.sampling import ServerLimits, check_limits, requested_max_tokens, sampling_params
from frontend.api.sse import PushedSSEResponse
from frontend.api.template_messages import template_message
from frontend.api.tools import template_tools, tool_mode
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput
from frontend.tokenizer import apply_chat_template, check_template_kwargs, encode, max_prompt_chars
from ipc import LoRARequest, SamplingParams
from ipc.request_rules import InvalidRequestError, check_max_tokens


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, limits: ServerLimits, observers: RequestObservers,
                 generation_defaults: Mapping[str, float | int] | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, adapters: LoRAAdapters | None = None,
                 media: MediaOptions | None = None) -> None:
        self.engine, self.model_name, self.limits, self.observers = engine, model_name, limits, observers
        self.media = media or MediaOptions()  # where images may come from, and their limits
        self.adapters = adapters or LoRAAdapters(model_name, {})  # the request's model: the base or an adapter
        self.generation_defaults = generation_defaults or {}
        self.tool_parser = tool_parser  # for tool_choice "auto"; None: "auto" is refused
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.max_prompt_chars = max_prompt_chars(engine.tokenizer, limits.max_model_len)

    async def completions(self, body: CompletionRequest):
        lora = self.adapters.resolve(body.model)
        served = self.model_name if lora is None else lora.lora_name  # the model the response names
        embeds = body.prompt_embeds is not None
        prompt_list = embeds_list(body, self.engine.info) if embeds else _prompt_list(body.prompt)
        check_limits(body, self.limits, len(prompt_list))
        params = sampling_params(body, self.limits, self.generation_defaults)
        read = functools.partial(read_prompt_embeds, self.engine.info) if embeds else self._completion_prompt
        # Tokenizing (or loading embeddings) runs on a thread (the tokenizer releases the GIL): a long prompt never
        # stalls other streams.
        prompts = await asyncio.to_thread(lambda: [self._prompt_choices(
            body, read(p), params, "prompt_embeds" if embeds else "prompt", lora) for p in prompt_list])
        if body.use_beam_search:
            refuse_beamless(body)
            found = await beam_search(self.engine, body, prompts, uuid.uuid4().hex, self.observers)
            choices = [CompletionChoice(index=i, text=s.text, finish_reason=s.finish_reason)
                       for i, s in enumerate(found)]
            return JSONResponse(CompletionResponse(model=served, usage=_usage(prompts), choices=choices).model_dump())
        echo = [self._prompt_text(p.prompt) if body.echo else "" for p in prompts]
        if body.stream:
            # Plain dicts on the per-token path: a pydantic model per chunk costs more than the rest of the chunk.
            head = CompletionResponse(model=served, choices=[]).model_dump(exclude={"choices", "usage"})
            return await StreamedChoices(self.engine, prompts, uuid.uuid4().hex, self.observers, OpenAIChunks(head),
                                         self._completion_choice(body, echo),
                                         _usage_chunks(head, body, prompts)).open()
        outputs = await final_outputs(self.engine, prompts, uuid.uuid4().hex, self.observers)
        choices = []
        for position, output in enumerate(outputs):
            prefix = self._echo_logprobs(output, echo[position], body.logprobs)
            for completion in output.outputs:
                choices.append(CompletionChoice(
                    index=len(choices), text=echo[position] + completion.text,
                    logprobs=join_logprobs(prefix, completion_logprobs(completion, body.logprobs or 0,
                                                                       len(echo[position]))),
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                    **_asked_prompt_fields(body, output), **_asked_token_ids(body, completion.token_ids)))
        response = CompletionResponse(model=served, usage=_usage(prompts), choices=choices)
        return JSONResponse(response.model_dump())

    async def chat(self, body: ChatCompletionRequest) -> Response:
        result = await self.chat_result(body, lambda head, prompts: OpenAIChunks(head))
        return result if isinstance(result, Response) else JSONResponse(result.model_dump())

    async def chat_result(self, body: ChatCompletionRequest, writer: Callable[[dict, list[PromptChoices]], ChunkWriter]
                          ) -> ChatCompletionResponse | PushedSSEResponse:
        """The chat path every chat-like API takes: the whole response, or (stream) its chunks as the writer that
        `writer(head, prompts)` makes puts them on the wire."""
        lora = self.adapters.resolve(body.model)
        served = self.model_name if lora is None else lora.lora_name  # the model the response names
        check_limits(body, self.limits)
        if body.use_beam_search:  # before the tools and constraints are read: they are refused by name
            refuse_beamless(body)
        if body.chat_template is not None:
            raise APIError(400, "chat_template is not accepted: the server uses the model's own template",
                           "chat_template")
        images = await chat_images(body.messages, self.media)
        media = await images_for_prompt(images, self.model_name, self.engine.router.image_processor) if images else {}
        text, prompt = await asyncio.to_thread(self.chat_prompt, body)
        prompt |= media
        params = sampling_params(body, self.limits, self.generation_defaults, self.tool_parser)
        start = None if self.reasoning_parser is None else section_start(self.reasoning_parser, text)
        if start is not None and params.structured_outputs is not None:  # the constraint starts after the thinking
            constraint = msgspec.structs.replace(params.structured_outputs,
                                                 reasoning=reasoning_section(start, self.engine.tokenizer))
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        prompts = [self._prompt_choices(body, prompt, params, "messages", lora)]
        if body.use_beam_search:
            found = await beam_search(self.engine, body, prompts, uuid.uuid4().hex, self.observers)
            return ChatCompletionResponse(model=served, usage=_usage(prompts), choices=[
                ChatChoice(index=i, message=ChatResponseMessage(content=s.text), finish_reason=s.finish_reason)
                for i, s in enumerate(found)])
        tools = ToolReader(tool_mode(body, self.tool_parser), self.tool_parser)
        if body.stream:
            head = ChatCompletionChunk(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                       model=served, choices=[]).model_dump(exclude={"choices", "usage"})
            role_chunks = [{**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], "usage": None}
                           for index in range(body.n)]
            if body.return_token_ids:
                role_chunks[0]["prompt_token_ids"] = prompt["prompt_token_ids"]
            return await StreamedChoices(self.engine, prompts, uuid.uuid4().hex, self.observers,
                                         writer(head, prompts), chat_chunks(body, tools, start),
                                         _usage_chunks(head, body, prompts), role_chunks).open()
        [output] = await final_outputs(self.engine, prompts, uuid.uuid4().hex, self.observers)
        choices = []
        for c in output.outputs:
            reasoning, content = (None, c.text) if start is None else split_reasoning(start, c.text)
            message, finish_reason = tools.message(content, c.finish_reason)
            message.reasoning_content = reasoning
            choices.append(ChatChoice(index=c.index, message=message, logprobs=chat_logprobs(c, body.top_logprobs or 0),
                                      finish_reason=finish_reason, stop_reason=c.stop_reason,
                                      **_asked_token_ids(body, c.token_ids)))
        return ChatCompletionResponse(model=served, usage=_usage(prompts), choices=choices,
                                      **_asked_prompt_fields(body, output))

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, dict]:
        """The conversation (its tools too) as the prompt: (text, {"prompt", "prompt_token_ids"})."""
        text = self._chat_text(body.messages, body.add_generation_prompt, template_tools(body),
                               body.chat_template_kwargs)
        return text, {"prompt": text, "prompt_token_ids": self._encode(text, "messages", add_special_tokens=False)}

    def tokenize(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            tokens = self._encode(body.prompt, "prompt", body.add_special_tokens)
        elif image_urls(body.messages):  # an image's tokens are the model's image processor's to count
            raise APIError(400, "/tokenize counts text only: these messages have image parts", "messages")
        else:
            tokens = self._encode(self._chat_text(body.messages, True, template_kwargs=body.chat_template_kwargs),
                                  "messages", add_special_tokens=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_model_len}

    def _completion_prompt(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            return {"prompt": prompt, "prompt_token_ids": self._encode(prompt, "prompt")}
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return {"prompt_token_ids": prompt}

    def _chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool, tools: list[dict] | None = None,
                   template_kwargs: dict | None = None) -> str:
        """The conversation (and the tools, for templates that render them) as prompt text, through the model's
        chat template."""
        try:
            check_template_kwargs(template_kwargs)
        except ValueError as error:
            raise APIError(400, str(error), "chat_template_kwargs") from None
        dicts = [template_message(m) for m in messages]
        try:
            return apply_chat_template(self.engine.tokenizer, dicts, self.model_name, add_generation_prompt,
                                       tools=tools, template_kwargs=template_kwargs)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters, which cannot fit in this model's context of "
                           f"{self.limits.max_model_len} tokens (at most {self.max_prompt_chars} characters)", field)
        try:
            return encode(self.engine.tokenizer, text, field, add_special_tokens)
        except ValueError as error:
            raise APIError(400, str(error), field) from error

    def _prompt_choices(self, body: SamplingFields, prompt: dict, params: SamplingParams,
                        field: str, lora: LoRARequest | None = None) -> PromptChoices:
        """The prompt's choices, once the prompt fits the context with the max_tokens asked for (OpenAI's rule;
        a default max_tokens ends where the context does)."""
        try:
            check_max_tokens(self.engine.info, len(prompt["prompt_token_ids"]), requested_max_tokens(body))
        except InvalidRequestError as error:
            raise APIError(400, str(error), field if error.param == "prompt" else error.param) from None
        if body.cache_salt is not None:
            prompt = {**prompt, "cache_salt": body.cache_salt}
        return PromptChoices(prompt, params, lora)

    def _prompt_text(self, prompt: dict) -> str:
        """The prompt as text (what echo shows): as sent, or decoded from the token ids sent."""
        if "prompt" in prompt:
            return prompt["prompt"]
        return self.engine.tokenizer.decode(prompt["prompt_token_ids"])

    def _echo_logprobs(self, output: RequestOutput, echo: str, num_top: int | None) -> dict | None:
        """The echoed prompt's part of a choice's logprobs (none without echo or logprobs)."""
        if not echo or num_top is None:
            return None
        first = self.engine.tokenizer.decode(output.prompt_token_ids[:1])
        return prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, first, num_top)

    def _completion_choice(self, body: CompletionRequest, echo: list[str]) -> Callable[[int, RequestOutput], dict]:
        """The function that turns one choice's delta output into the choice of a completions chunk; a choice's first
        chunk starts with its echoed prompt."""
        text_offsets = [0] * (len(echo) * body.n)
        echoed = [not body.echo] * len(text_offsets)
        started = [False] * len(text_offsets)
        num_top = body.logprobs or 0

        def choice(index: int, output: RequestOutput) -> dict:
            completion = output.outputs[0]
            text, logprobs = completion.text, None
            if not echoed[index]:
                prompt, echoed[index] = echo[index // body.n], True
                text, text_offsets[index] = prompt + text, len(prompt)
                logprobs = self._echo_logprobs(output, prompt, body.logprobs)
            logprobs = join_logprobs(logprobs, completion_logprobs(completion, num_top, text_offsets[index]))
            text_offsets[index] += len(completion.text)
            chunk = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                     "stop_reason": completion.stop_reason, **_asked_token_ids(body, completion.token_ids)}
            if body.return_token_ids and not started[index]:
                chunk["prompt_token_ids"] = output.prompt_token_ids
            started[index] = True
            return chunk
        return choice


def _asked_prompt_fields(body: SamplingFields, output: RequestOutput) -> dict:
    """vLLM's prompt fields of a whole response, where the request asks for them."""
    fields = {}
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
    if body.return_token_ids:
        fields["prompt_token_ids"] = list(output.prompt_token_ids)
    return fields


def _asked_token_ids(body: SamplingFields, token_ids: list[int]) -> dict:
    """A choice's (or a chunk's) token ids, with return_token_ids."""
    return {"token_ids": list(token_ids)} if body.return_token_ids else {}


def _usage_chunks(head: dict, body: SamplingFields, prompts: list[PromptChoices]) -> Callable[[], list[dict]]:
    """The usage chunk a stream ends with when stream_options.include_usage asks for it."""
    def chunks() -> list[dict]:
        if not (body.stream_options and body.stream_options.include_usage):
            return []
        return [{**head, "choices": [], "usage": _usage(prompts).model_dump()}]
    return chunks


def _usage(prompts: list[PromptChoices]) -> UsageInfo:
    num_prompt_tokens = sum(p.num_prompt_tokens for p in prompts)
    completion = sum(p.num_completion_tokens for p in prompts)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    return list(prompt)
