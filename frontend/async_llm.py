"""AsyncLLM: the asyncio front end for servers; streams each request's outputs from an engine-core process."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections.abc import AsyncGenerator
from typing import Protocol

from frontend.connect import connect_engine
from frontend.core_client import DEFAULT_MAX_STALL_S, AsyncEngineCoreClient, EngineDeadError, request_error
from frontend.output_processor import OutputProcessor
from frontend.outputs import RequestOutput, merge_delta
from frontend.parallel_sampling import child_params, child_request_id, merge_samples
from frontend.prompts import PromptType, engine_request, prompt_text
from frontend.stream_merge import merge_streams
from frontend.tokenizer import load_tokenizer
from ipc import EngineCoreOutputs, RequestOutputKind, SamplingParams, SchedulerStats

logger = logging.getLogger("pagedserve.async_llm")
# Outputs of one engine step are turned into RequestOutputs this many at a time, yielding to the event loop
# in between, so a step with hundreds of requests does not stall other coroutines (e.g. HTTP handlers).
OUTPUT_CHUNK_SIZE = 128


class OutputSink(Protocol):
    """Where the output handler hands a request's outputs."""

    def put(self, item: RequestOutput | Exception) -> None:
        """One output, or the error that ends the request. Called on the event loop; must not block or raise."""


class RequestOutputCollector:
    """An OutputSink that holds one request's outputs until its consumer takes them. A consumer that falls behind
    gets one merged output: DELTA outputs are concatenated, CUMULATIVE ones replaced by the newest."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self.item: RequestOutput | Exception | None = None
        self.waiter: asyncio.Future[None] | None = None  # a bare future: cheaper per token than an asyncio.Event

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(self.item, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_delta(self.item, item) if self.output_kind == RequestOutputKind.DELTA else item
        elif isinstance(self.item, RequestOutput) and self.item.finished:
            return  # the final output is already waiting; a later error (engine death) changes nothing
        self.item = item
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while self.item is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item, self.item = self.item, None
        if isinstance(item, Exception):
            raise item
        return item


class AsyncLLM:
    """`AsyncLLM(model, **engine_args)` starts a private engine core; `AsyncLLM(engine_address=..., model=...)`
    attaches to a running one (the model folder is then only for the tokenizer; default: the engine's)."""

    def __init__(self, model: str | None = None, *, engine_address: str | None = None,
                 curve_key_file: str | None = None, handshake_timeout: float = 30.0, **engine_args) -> None:
        self.client: AsyncEngineCoreClient = connect_engine(
            model, engine_args, engine_address=engine_address, curve_key_file=curve_key_file,
            handshake_timeout=handshake_timeout, asynchronous=True)
        self._shutdown = weakref.finalize(self, self.client.shutdown)
        self.info = self.client.info
        self.tokenizer = load_tokenizer(model or self.info.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sinks: dict[str, OutputSink] = {}
        self.output_handler: asyncio.Task | None = None

    @property
    def errored(self) -> bool:
        return self.client.dead_reason is not None

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (each step's, as sampling_params.output_kind says); the last one has
        finished=True. Closing or cancelling the stream aborts the request in the engine. With n > 1 each
        output carries the sample (CompletionOutput.index) it is about; FINAL_ONLY gives one output of all n."""
        params = sampling_params or SamplingParams()
        request_id = uuid.uuid4().hex if request_id is None else request_id
        stream = self._generate_one if not isinstance(params, SamplingParams) or params.n == 1 else self._generate_n
        return stream(prompt, params, request_id, priority)

    async def _generate_one(self, prompt: PromptType, params: SamplingParams, request_id: str,
                            priority: int) -> AsyncGenerator[RequestOutput, None]:
        collector = RequestOutputCollector(params.output_kind)
        self.add_request(request_id, prompt, params, collector, priority)
        try:
            while True:
                output = await collector.get()
                yield output
                if output.finished:
                    return
        finally:  # cancelled, closed early, or failed: release aborts the request if it has not finished
            self.release(request_id, collector)

    async def _generate_n(self, prompt: PromptType, params: SamplingParams, request_id: str,
                          priority: int) -> AsyncGenerator[RequestOutput, None]:
        samples = [self._generate_one(prompt, child_params(params, index), child_request_id(request_id, index),
                                      priority) for index in range(params.n)]
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(merge_streams(samples)) as outputs:
            async for index, output in outputs:
                if output.finished:
                    finals[index] = output
                if params.output_kind != RequestOutputKind.FINAL_ONLY:
                    output.request_id, output.outputs[0].index = request_id, index
                    output.finished = len(finals) == params.n
                    yield output
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            yield merge_samples(request_id, [finals[index] for index in range(params.n)])

    async def abort(self, request_id: str) -> None:
        """End the request now; its stream yields a final output with finish_reason "abort"."""
        output = self.output_processor.abort(request_id)
        sink = self.sinks.get(request_id)
        if output is not None and sink is not None:
            sink.put(output)
        self.client.abort_requests([request_id])

    async def get_stats(self) -> SchedulerStats:
        return await self.client.get_stats_async()

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def start_profile(self) -> str:
        """Start the engine's profiler (needs profiler_dir); returns the directory its trace will go to."""
        return await self.client.call_utility_async("start_profile")

    async def stop_profile(self) -> str:
        return await self.client.call_utility_async("stop_profile")

    async def check_health(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        """Raises EngineDeadError if the engine core is gone, has sent no heartbeat for 10 s, or its loop has not
        advanced for max_stall_s (a wedged step); answers at once, however busy the engine is."""
        await self.client.check_health_async(max_stall_s)

    def shutdown(self) -> None:
        """Stop the engine core this AsyncLLM started (also done when it is garbage collected or at exit)."""
        if self.output_handler is not None:
            self.output_handler.cancel()
        self._shutdown()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, sink: OutputSink,
                    priority: int = 0) -> None:
        """Send one request (n=1) to the engine; the output handler hands each of its outputs, or the error that
        ends it, to sink.put. The caller must release(request_id, sink) once it no longer wants them.
        generate() is this with a queue in between; a server writing each output out at once needs none."""
        if params.n != 1:
            raise ValueError("add_request takes one sample (n=1); generate() runs n > 1")
        if request_id in self.sinks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = engine_request(self.tokenizer, self.info, request_id, prompt, params, priority)
        self.client.add_request(request)  # raises EngineDeadError before anything is registered
        self.sinks[request_id] = sink
        self.output_processor.add_request(request_id, prompt_text(prompt), request.prompt_token_ids, params)
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    def release(self, request_id: str, sink: OutputSink) -> None:
        """Stop handing the request's outputs to sink, and abort the request if it has not finished."""
        if self.sinks.get(request_id) is not sink:
            return
        del self.sinks[request_id]
        if self.output_processor.abort(request_id) is not None:  # still running
            self.client.abort_requests([request_id])

    async def _handle_outputs(self) -> None:
        try:
            while True:
                await self._deliver(await self.client.get_outputs_async())
        except EngineDeadError as error:
            for sink in list(self.sinks.values()):  # a sink may release itself
                sink.put(error)
        except Exception as error:  # a bug here must fail the streams, not leave them waiting forever
            logger.exception("the output handler failed")
            for sink in list(self.sinks.values()):
                sink.put(EngineDeadError(f"the output handler failed: {error}"))

    async def _deliver(self, batch: EngineCoreOutputs) -> None:
        for error in batch.errors:
            sink = self.sinks.get(error.request_id)
            if sink is None:
                logger.warning("engine error for no request of ours: %s", error.message)
                continue
            self.output_processor.abort(error.request_id)
            sink.put(request_error(error))
        outputs = batch.outputs
        for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            results, to_abort = self.output_processor.process_outputs(outputs[start:start + OUTPUT_CHUNK_SIZE])
            for result in results:
                sink = self.sinks.get(result.request_id)
                if sink is not None:
                    sink.put(result)
            self.client.abort_requests(to_abort)
