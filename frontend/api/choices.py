"""Run the choices of one OpenAI request (n per prompt) as engine requests, recording metrics (TTFT, inter-token
latency, end-to-end, token counts): as one list of final outputs, or as server-sent events written as they come."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend.api.errors import APIError, engine_error, error_body, raise_api_error
from frontend.api.metrics import ServerMetrics
from frontend.api.sse import SSE_DONE, PushedSSEResponse, sse_event
from frontend.async_llm import AsyncLLM
from frontend.outputs import CompletionOutput, RequestOutput
from frontend.prompts import PromptType
from frontend.stream_merge import merge_streams
from ipc import SamplingParams

logger = logging.getLogger("pagedserve.api")


@dataclass
class Choice:
    """One engine request behind a choice; its token count grows as the stream goes."""

    prompt: PromptType
    params: SamplingParams
    num_prompt_tokens: int
    num_completion_tokens: int = 0


async def final_outputs(engine: AsyncLLM, choices: list[Choice], request_id: str,
                        metrics: ServerMetrics) -> list[CompletionOutput]:
    """Each choice's final output (the choices ask for FINAL_ONLY); cancelling aborts every unfinished one."""
    start = time.monotonic()
    finals: list[CompletionOutput | None] = [None] * len(choices)
    streams = [engine.generate(choice.prompt, choice.params, f"{request_id}-{index}")
               for index, choice in enumerate(choices)]
    try:
        async with contextlib.aclosing(merge_streams(streams)) as outputs:
            async for index, output in outputs:
                finals[index] = output.outputs[0]
                choices[index].num_completion_tokens = len(output.outputs[0].token_ids)
    except Exception as error:
        raise_api_error(error)
    metrics.observe_request(sum(c.num_prompt_tokens for c in choices), sum(c.num_completion_tokens for c in choices),
                            time.monotonic() - start)
    return finals


class StreamedChoices:
    """The choices of one streamed request as server-sent events. The engine's output handler hands each output to
    put(); it is rendered by `chunk` and emitted at once. After every choice's final output come final_chunks() and
    [DONE]; after an error, an error event and [DONE]."""

    def __init__(self, engine: AsyncLLM, choices: list[Choice], request_id: str, metrics: ServerMetrics,
                 chunk: Callable[[int, RequestOutput], dict], final_chunks: Callable[[], list[dict]],
                 head_chunks: Sequence[dict] = ()) -> None:
        self.engine, self.choices, self.metrics = engine, choices, metrics
        self.chunk, self.final_chunks = chunk, final_chunks
        self.sinks = [(f"{request_id}-{index}", _ChoiceSink(self, index)) for index in range(len(choices))]
        self.response = PushedSSEResponse(on_close=self.close)
        for body in head_chunks:
            self.response.emit(sse_event(body))
        self.start = time.monotonic()
        self.last: list[float | None] = [None] * len(choices)
        self.num_finished = 0
        self.ended = False
        self.answered = asyncio.get_running_loop().create_future()  # resolved by the first output or error

    async def open(self) -> PushedSSEResponse:
        """Send the choices to the engine and wait for the first output, so that a refused request (full queue,
        bad input, engine gone) gets its status code instead of a 200 stream that fails."""
        try:
            for (request_id, sink), choice in zip(self.sinks, self.choices):
                self.engine.add_request(request_id, choice.prompt, choice.params, sink)
            await self.answered  # raises the error that came first, if one did
        except Exception as error:
            self.close()
            raise_api_error(error)
        except BaseException:  # cancelled (the client went away): nothing may stay registered
            self.close()
            raise
        return self.response

    def put(self, index: int, item: RequestOutput | Exception) -> None:
        if self.ended:
            return
        if isinstance(item, Exception):
            self._end(item)
            return
        try:
            now, last = time.monotonic(), self.last[index]
            self.metrics.observe_token_times(now - self.start if last is None else None,
                                             now - last if last is not None else None)
            self.last[index] = now
            self.choices[index].num_completion_tokens += len(item.outputs[0].token_ids)
            self.response.emit(sse_event(self.chunk(index, item)))
        except Exception as error:  # a bug here must end this stream, not the output handler serving all of them
            logger.exception("rendering a streamed output failed")
            self._end(error)
            return
        if not self.answered.done():
            self.answered.set_result(None)
        if item.finished:
            self.num_finished += 1
            if self.num_finished == len(self.choices):
                self._end(None)

    def close(self) -> None:
        """Release every choice's engine request, aborting those not finished (the stream ended or was dropped)."""
        for request_id, sink in self.sinks:
            self.engine.release(request_id, sink)

    def _end(self, error: Exception | None) -> None:
        self.ended = True
        if error is not None and not self.answered.done():
            self.answered.set_exception(error)  # open() answers with the error's status code
            return
        if error is None:
            self.metrics.observe_request(sum(c.num_prompt_tokens for c in self.choices),
                                         sum(c.num_completion_tokens for c in self.choices),
                                         time.monotonic() - self.start)
            tail = b"".join(sse_event(body) for body in self.final_chunks())
        else:  # the headers are out: the error goes in the stream, as OpenAI does
            mapped = engine_error(error) or APIError(500, f"internal error: {type(error).__name__}")
            tail = sse_event(error_body(mapped.status, mapped.message, mapped.param, mapped.code))
        self.response.end(tail + SSE_DONE)


class _ChoiceSink:
    """The OutputSink of one choice's engine request."""

    __slots__ = ("stream", "index")

    def __init__(self, stream: StreamedChoices, index: int) -> None:
        self.stream, self.index = stream, index

    def put(self, item: RequestOutput | Exception) -> None:
        self.stream.put(self.index, item)
