"""AsyncLLM: the asyncio front end for servers; streams each request's outputs from an engine-core process."""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
import weakref
from collections.abc import AsyncGenerator

from frontend.connect import connect_engine
from frontend.async_core_client import AsyncEngineCoreClient
from frontend.core_client import DEFAULT_MAX_STALL_S, EngineDeadError
from frontend.generation_config import model_stop_token_ids
from frontend.multimodal import ImageProcessor
from frontend.output_collector import RequestOutputCollector
from frontend.outputs import RequestOutput
from frontend.prompts import PromptType, check_sampling_params
from frontend.request_group import OutputCallback, RequestGroup
from frontend.request_router import RequestRouter
from frontend.tokenizer import load_tokenizer, model_folder, tokenizer_folder
from ipc import EngineCoreOutputs, EngineCoreRequest, LoRARequest, SamplingParams, SchedulerStats

logger = logging.getLogger("pagedserve.async_llm")
# Outputs of one engine step are turned into RequestOutputs this many at a time, yielding to the event loop
# in between, so a step with hundreds of requests does not stall other coroutines (e.g. HTTP handlers).
OUTPUT_CHUNK_SIZE = 128


class AsyncLLM:
    """`AsyncLLM(model, **engine_args)` starts a private engine core; `AsyncLLM(engine_address=..., model=...)`
    attaches to a running one (the model folder is then only for the tokenizer; default: the engine's)."""

    def __init__(self, model: str | None = None, *, engine_address: str | list[str] | None = None,
                 curve_key_file: str | None = None, handshake_timeout: float = 30.0, **engine_args) -> None:
        files = tokenizer_folder(model, engine_args.get("tokenizer")) if model else None  # before an engine starts
        self.client: AsyncEngineCoreClient = connect_engine(
            model, engine_args, engine_address=engine_address, curve_key_file=curve_key_file,
            handshake_timeout=handshake_timeout, asynchronous=True)
        self._shutdown = weakref.finalize(self, self.client.shutdown)
        self.info = self.client.info
        self.tokenizer = load_tokenizer(files or self.info.model)
        model_files = model_folder(model or self.info.model, files)  # generation_config.json
        self.router = RequestRouter(self.client, self.tokenizer, self.info,
                                    model_stop_token_ids(model_files, self.tokenizer.eos_token_id),
                                    ImageProcessor.of(model_files, self.info))
        self.output_handler: asyncio.Task | None = None

    @property
    def errored(self) -> bool:
        return self.client.dead_reason is not None

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (each step's, as sampling_params.output_kind says); the last one has
        finished=True. Closing or cancelling the stream aborts the request in the engine. With n > 1 each
        output carries the sample (CompletionOutput.index) it is about; FINAL_ONLY gives one output of all n."""
        params = sampling_params or SamplingParams()
        return self._generate(prompt, params, uuid.uuid4().hex if request_id is None else request_id, priority,
                              lora_request)

    async def _generate(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int,
                        lora_request: LoRARequest | None) -> AsyncGenerator[RequestOutput, None]:
        collector = RequestOutputCollector(check_sampling_params(params).output_kind)
        group = self.add_request(request_id, prompt, params, collector.put, priority, lora_request)
        try:
            while True:
                output = await collector.get()
                yield output
                if output.finished:
                    return
        finally:  # cancelled, closed early, or failed: release aborts the request if it has not finished
            self.release(group)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, on_output: OutputCallback,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> RequestGroup:
        """Send the request (its n samples) to the engine; its outputs, then its final output or the error that ends
        it, go to on_output (on the event loop, as they arrive). The caller must release() the returned group
        once it no longer wants them. generate() is this with a collector in between; a server writing each
        output out at once needs none."""
        group = self.router.add(request_id, prompt, params, on_output, priority, lora_request)
        self._handle_outputs_soon()
        return group

    async def encode(self, requests: list[EngineCoreRequest]) -> list[bytes]:
        """Run validated pooling requests (frontend.pooling_inputs); their pooled vectors in order. The first
        error raises, and the requests still running are aborted (also when the caller is cancelled)."""
        loop = asyncio.get_running_loop()
        results = [loop.create_future() for _ in requests]
        try:
            for request, result in zip(requests, results):
                self.router.add_pooling(request, functools.partial(_settle, result))
            self._handle_outputs_soon()
            return await asyncio.gather(*results)
        finally:
            for request in requests:
                self.router.release_pooling(request.request_id)

    def _handle_outputs_soon(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    def release(self, group: RequestGroup) -> None:
        """Stop handing the group's outputs on, and abort whatever of it has not finished."""
        self.router.release(group)

    async def abort(self, request_id: str) -> None:
        """End the request now; its stream yields a final output with finish_reason "abort"."""
        self.router.abort(request_id)

    async def get_stats(self) -> SchedulerStats:
        return await self.client.get_stats_async()

    async def check_lora(self, lora: LoRARequest) -> None:
        """RuntimeError with the engine's reason if it would refuse requests naming this adapter."""
        await self.client.call_utility_async("check_lora", lora.lora_name, lora.lora_int_id, lora.lora_path)

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

    async def check_serving(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        """Raises EngineDeadError if no engine core can take requests: with data parallel, while one can this passes
        where check_health fails."""
        await self.client.check_serving_async(max_stall_s)

    def shutdown(self) -> None:
        """Stop the engine core this AsyncLLM started (also done when it is garbage collected or at exit)."""
        if self.output_handler is not None:
            self.output_handler.cancel()
        self._shutdown()

    async def _handle_outputs(self) -> None:
        try:
            while True:
                await self._deliver(await self.client.get_outputs_async())
        except EngineDeadError as error:
            self.router.fail_all(error)
        except Exception as error:  # a bug here must fail the streams, not leave them waiting forever
            logger.exception("the output handler failed")
            self.router.fail_all(EngineDeadError(f"the output handler failed: {error}"))

    async def _deliver(self, batch: EngineCoreOutputs) -> None:
        for stray in self.router.route_errors(batch.errors):
            logger.warning("engine error for no request of ours: %s", stray.message)
        outputs = batch.outputs
        for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            self.router.route(outputs[start:start + OUTPUT_CHUNK_SIZE])


def _settle(result: asyncio.Future, item: bytes | Exception) -> None:
    if result.done():
        return
    if isinstance(item, Exception):
        result.set_exception(item)
    else:
        result.set_result(item)
