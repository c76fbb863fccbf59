"""Run the prompts of one OpenAI request (n choices each, one request group per prompt) through the engine, recording
metrics (TTFT, inter-token latency, end-to-end, token counts): as final outputs, or as server-sent events written as
they come."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from frontend.api.errors import APIError, engine_error, raise_api_error
from frontend.api.metrics import ServerMetrics
from frontend.api.request_log import RequestLogger
from frontend.api.sse import SSE_DONE, ChoiceEvents, PushedSSEResponse, sse_event
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput
from frontend.request_group import FinalOutputs, RequestGroup, child_request_id
from ipc import LoRARequest, SamplingParams

logger = logging.getLogger("pagedserve.api")


@dataclass
class RequestObservers:
    """Who hears of a request's end: the Prometheus metrics, and the request log unless it is off."""

    metrics: ServerMetrics
    request_logger: RequestLogger | None = None

    @property
    def wants_text(self) -> bool:
        return self.request_logger is not None and self.request_logger.log_prompts

    def request_ended(self, request_id: str, prompts: list[PromptChoices], finish_reasons: list[str | None],
                      seconds: float, texts: list[str] | None) -> None:
        num_prompt_tokens = sum(p.num_prompt_tokens for p in prompts)
        num_completion_tokens = sum(p.num_completion_tokens for p in prompts)
        self.metrics.observe_request(num_prompt_tokens, num_completion_tokens, seconds, finish_reasons)
        if self.request_logger is not None:
            shown = [p.prompt.get("prompt", p.prompt["prompt_token_ids"]) for p in prompts] if self.wants_text else None
            self.request_logger.log_request(request_id, num_prompt_tokens, num_completion_tokens, finish_reasons,
                                            seconds, _one_or_all(shown),
                                            _one_or_all(texts if self.wants_text else None))


@dataclass
class PromptChoices:
    """One prompt of a request and the params of its n choices; their token count grows as the stream goes."""

    prompt: dict  # {"prompt": text (if given as text), "prompt_token_ids": [...], "multi_modal_data"}
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter the request's model names
    num_completion_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Its tokens as the engine computes them: each image's one placeholder as its processed features."""
        images = self.prompt.get("multi_modal_data", {}).get("image", [])
        return len(self.prompt["prompt_token_ids"]) + sum(image.length - 1 for image in images)


async def final_outputs(engine: AsyncLLM, prompts: list[PromptChoices], request_id: str,
                        observers: RequestObservers | None) -> list[RequestOutput]:
    """Each prompt's final output with its n choices (the params ask for FINAL_ONLY); cancelling aborts them all.
    observers: None for requests that are part of another (a beam search's steps), observed at its end."""
    start = time.monotonic()
    ended = asyncio.get_running_loop().create_future()
    finals = FinalOutputs(len(prompts), on_end=lambda: ended.set_result(None))
    groups: list[RequestGroup] = []
    try:
        for position, choices in enumerate(prompts):
            part_id = child_request_id(request_id, position, len(prompts))
            groups.append(engine.add_request(part_id, choices.prompt, choices.params, finals.callback(position),
                                             lora_request=choices.lora_request))
        await ended
        if finals.error is not None:
            raise finals.error
    except Exception as error:
        raise_api_error(error)
    finally:  # cancelled (the client went away) or failed: nothing may keep running
        for group in groups:
            engine.release(group)
    for choices, output in zip(prompts, finals.outputs):
        choices.num_completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
    completions = [completion for output in finals.outputs for completion in output.outputs]
    if observers is not None:
        observers.request_ended(request_id, prompts, [c.finish_reason for c in completions],
                                time.monotonic() - start, [c.text for c in completions])
    return finals.outputs


def _one_or_all(items: list | None) -> object:
    """One prompt's (or output's) text as itself, several as a list."""
    return items[0] if items is not None and len(items) == 1 else items


class ChunkWriter(Protocol):
    """How a stream's chunks (OpenAI chunk dicts) go on the wire: OpenAI's own events, or another API's."""

    def choice(self, choice: dict) -> bytes:
        """The event(s) of one output's chunk, which has this one choice."""

    def chunk(self, chunk: dict) -> bytes:
        """The event(s) of a whole chunk: the ones a stream starts with, and its usage chunk."""

    def end(self) -> bytes:
        """What ends a stream that finished."""

    def error(self, error: APIError) -> bytes:
        """What ends a stream that failed once its headers were out."""


class OpenAIChunks:
    """OpenAI's stream: each chunk as a data: line, then [DONE]; a failure as an error body, then [DONE]."""

    def __init__(self, head: dict) -> None:
        self.events = ChoiceEvents(head)

    def choice(self, choice: dict) -> bytes:
        return self.events.event(choice)

    def chunk(self, chunk: dict) -> bytes:
        return sse_event(chunk)

    def end(self) -> bytes:
        return SSE_DONE

    def error(self, error: APIError) -> bytes:
        return sse_event(error.body()) + SSE_DONE


class StreamedChoices:
    """The choices of one streamed request as server-sent events. The engine's output handler hands each output to
    put(); it is rendered as the chunk {**head, "choices": [choice(choice index, output)], "usage": null} and emitted
    at once through `writer`. After every prompt's final output come final_chunks() and the writer's end; after an
    error, the writer's error."""

    def __init__(self, engine: AsyncLLM, prompts: list[PromptChoices], request_id: str, observers: RequestObservers,
                 writer: ChunkWriter, choice: Callable[[int, RequestOutput], dict | None],
                 final_chunks: Callable[[], list[dict]],
                 head_chunks: Sequence[dict] = ()) -> None:
        self.engine, self.prompts, self.request_id, self.observers = engine, prompts, request_id, observers
        self.writer, self.choice, self.final_chunks = writer, choice, final_chunks
        self.n = prompts[0].params.n
        self.groups: list[RequestGroup] = []
        self.response = PushedSSEResponse(on_close=self.close)
        for body in head_chunks:
            self.response.emit(writer.chunk(body))
        self.start = time.monotonic()
        self.last: list[float | None] = [None] * (len(prompts) * self.n)
        self.finish_reasons: list[str | None] = [None] * len(self.last)
        self.texts: list[str] | None = [""] * len(self.last) if observers.wants_text else None
        self.num_finished = 0
        self.ended = False
        self.answered = asyncio.get_running_loop().create_future()  # resolved by the first output or error

    async def open(self) -> PushedSSEResponse:
        """Send the prompts to the engine and wait for the first output, so that a refused request (full queue,
        bad input, engine gone) gets its status code instead of a 200 stream that fails."""
        try:
            for position, choices in enumerate(self.prompts):
                part_id = child_request_id(self.request_id, position, len(self.prompts))
                self.groups.append(self.engine.add_request(part_id, choices.prompt, choices.params,
                                                           functools.partial(self.put, position),
                                                           lora_request=choices.lora_request))
            await self.answered  # raises the error that came first, if one did
        except Exception as error:
            self.close()
            raise_api_error(error)
        except BaseException:  # cancelled (the client went away): nothing may stay registered
            self.close()
            raise
        return self.response

    def put(self, position: int, item: RequestOutput | Exception) -> None:
        if self.ended:
            return
        if isinstance(item, Exception):
            self._end(item)
            return
        try:
            completion = item.outputs[0]
            index = position * self.n + completion.index
            now, last = time.monotonic(), self.last[index]
            self.observers.metrics.observe_token_times(now - self.start if last is None else None,
                                                       now - last if last is not None else None)
            self.last[index] = now
            self.finish_reasons[index] = completion.finish_reason
            if self.texts is not None:
                self.texts[index] += completion.text
            self.prompts[position].num_completion_tokens += len(completion.token_ids)
            if (choice := self.choice(index, item)) is not None:  # None: nothing to show for this output yet
                self.response.emit(self.writer.choice(choice))
        except Exception as error:  # a bug here must end this stream, not the output handler serving all of them
            logger.exception("rendering a streamed output failed")
            self._end(error)
            return
        if not self.answered.done():
            self.answered.set_result(None)
        if item.finished:
            self.num_finished += 1
            if self.num_finished == len(self.prompts):
                self._end(None)

    def close(self) -> None:
        """Release every prompt's request group, aborting what has not finished (the stream ended or was dropped)."""
        for group in self.groups:
            self.engine.release(group)

    def _end(self, error: Exception | None) -> None:
        self.ended = True
        if error is not None and not self.answered.done():
            self.answered.set_exception(error)  # open() answers with the error's status code
            return
        if error is None:
            self.observers.request_ended(self.request_id, self.prompts, self.finish_reasons,
                                         time.monotonic() - self.start, self.texts)
            tail = b"".join(self.writer.chunk(body) for body in self.final_chunks()) + self.writer.end()
        else:  # the headers are out: the error goes in the stream, as OpenAI does
            tail = self.writer.error(engine_error(error) or APIError(500, f"internal error: {type(error).__name__}"))
        self.response.end(tail)
