"""EngineCore: validates requests, owns the scheduler and KV cache manager, and runs one step at a time."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import msgspec

from core import engine_checks
from core.kv_cache_manager import KVCacheManager
from core.kv_offload import check_offload
from core.kv_transfer import make_connector
from core.profiler import EngineProfiler
from core.request import Request
from core.scheduler import Scheduler
from core.waves import Waves, check_waves_config
from ipc import (EngineConfig, EngineCoreOutput, EngineCoreRequest, EngineInfo, FinishReason, LoRARequest,
                 SchedulerStats)
from ipc.request_rules import context_room
from workers.executor import Executor, InProcessExecutor
from workers.model_config import check_parallel_sizes, load_hf_config, model_max_len
from workers.lora.validation import AdapterValidator
from workers.models.registry import check_prompt_embeds, image_inputs
from workers.pooling.config import is_encoder, max_seq_length, pooling_info
from workers.quantization import check_quantization

if TYPE_CHECKING:
    from core.structured_output.manager import StructuredOutputManager

_IDLE_WAIT_S = 0.05  # with only grammars compiling or KV arriving, the loop checks its inputs this often
UTILITY_METHODS = frozenset({"get_info", "get_stats", "check_health", "check_lora"})
# Callable only when the engine's config allows them (EngineInfo.privileged_utilities lists those it does).
PROFILER_METHODS = frozenset({"start_profile", "stop_profile"})
CACHE_RESET_METHODS = frozenset({"reset_prefix_cache"})


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        hf_config = load_hf_config(config.model)
        text_config = hf_config.get_text_config()  # a vision-language model's language model, else the model's
        encoder = is_encoder(hf_config)
        pooling = pooling_info(config.model, hf_config, config.pooler_config)
        runner = engine_checks.resolve_runner(config.runner, pooling.generates)
        if encoder:
            engine_checks.check_encoder_config(config)
        # A sentence-transformers folder's max_seq_length is where its own library truncates: the default limit.
        limit = min(model_max_len(text_config), max_seq_length(config.model) or model_max_len(text_config))
        self.config = engine_checks.resolve_max_model_len(config, limit)
        if encoder and self.config.max_num_batched_tokens < self.config.max_model_len:  # a request runs whole
            self.config = msgspec.structs.replace(self.config, max_num_batched_tokens=self.config.max_model_len)
        self.vocab_size: int = text_config.vocab_size
        # Made for the first constrained request, never before: the compile workers' imports take CPU from the
        # steps for seconds even at idle priority, which an engine that serves no grammar should never pay.
        self._structured: StructuredOutputManager | None = None
        check_parallel_sizes(text_config, self.config.tensor_parallel_size, self.config.pipeline_parallel_size,
                             self.config.enable_expert_parallel)
        check_quantization(self.config.model, hf_config, self.config.quantization)  # here, not in a rank
        engine_checks.check_draft_model(self.config, text_config.vocab_size)
        check_offload(self.config)
        check_waves_config(self.config)
        self.waves = Waves.join(self.config) if self.config.data_parallel_ep_address is not None else None
        if self.config.enable_prompt_embeds:
            check_prompt_embeds(hf_config)
        self.lora_validator = AdapterValidator(hf_config, config.max_lora_rank, config.lora_dirs) \
            if config.enable_lora else None
        self.executor = _make_executor(self.config)
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        if not encoder:
            engine_checks.check_capacity(self.config, self.num_kv_blocks)
        weight_bytes = self.executor.weight_bytes()  # before the KV cache: Ray ranks then enter their step loop
        num_host_blocks = self.executor.num_host_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, self.config.block_size,
                                               self.config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, whole_prompts=encoder,
                                   decode_ahead=self.executor.decodes_ahead(), multi_step=self.executor.multi_steps(),
                                   multi_step_grammars=self.executor.steps_grammars())
        transfer = self.config.kv_transfer_config
        if transfer is not None and not encoder:
            self.scheduler.connector = make_connector(transfer, self.executor.kv_transfer_endpoint(),
                                                      self.kv_cache_manager)
        self._arrivals = itertools.count()
        self.batches_submitted = 0
        self.profiler = None if config.profiler_dir is None else EngineProfiler(
            config.profiler_dir, config.profiler_max_seconds, config.profiler_max_steps)
        self.info = EngineInfo(model=self.config.model, max_model_len=self.config.max_model_len,
                               vocab_size=self.vocab_size, num_kv_blocks=self.num_kv_blocks,
                               block_size=self.config.block_size, weight_bytes=weight_bytes,
                               scheduling_policy=self.config.scheduling_policy,
                               privileged_utilities=sorted(self._privileged_utilities()),
                               max_logprobs=self.config.max_logprobs, runner=runner, pooling=pooling,
                               hidden_size=text_config.hidden_size,
                               enable_prompt_embeds=self.config.enable_prompt_embeds,
                               kv_role=transfer.kv_role if transfer is not None else None, **image_inputs(hf_config))

    def validate_request(self, request: EngineCoreRequest, request_id: str | None = None) -> None:
        """Raise ValueError naming what is wrong; nothing is queued. `request_id`: the id the engine will hold it
        under, if not request.request_id (the engine process scopes each client's ids)."""
        self.info.validate_request(request)
        if self.has_request(request_id or request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None:
            if self.lora_validator is None:
                raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True "
                                 "(--enable-lora)")
            self.lora_validator.check(request.lora_request)

    def is_overloaded(self) -> bool:
        """The waiting queue is at max_waiting_requests: new requests are refused until it drains."""
        limit = self.config.max_waiting_requests
        return limit is not None and self.scheduler.num_waiting >= limit

    def request_ids(self) -> list[str]:
        """Every request the engine holds: running, waiting, or waiting for its grammar."""
        compiling = [] if self._structured is None else list(self._structured.pending)
        return [*self.scheduler.requests, *compiling]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or (
            self._structured is not None and request_id in self._structured.pending)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request that passed validate_request (a constrained one once its grammar has compiled)."""
        if request.pooling_params is not None:
            queued = Request(request, next(self._arrivals), max_tokens=0)
            queued.reads_prefix_cache = self.info.pooling.pooling_type == "LAST"  # the one row it pools is computed
            self.scheduler.add_request(queued)
            return
        room = context_room(self.info, len(request.prompt_token_ids))
        max_tokens = min(request.sampling_params.max_tokens or room, room)
        queued = Request(request, next(self._arrivals), max_tokens)
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(queued)
        else:
            self.structured.add(queued)

    @property
    def structured(self) -> StructuredOutputManager:
        if self._structured is None:
            self._structured = self._structured_output()
        return self._structured

    def _structured_output(self) -> StructuredOutputManager:
        from core.structured_output.manager import StructuredOutputManager  # xgrammar: only when used

        config = self.config
        return StructuredOutputManager(config.tokenizer or config.model, self.vocab_size,
                                       config.structured_outputs_compile_timeout,
                                       config.structured_outputs_compile_memory_mb,
                                       config.structured_outputs_cache_mb << 20)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish these requests and free their blocks; a final ABORT output for each one still running."""
        compiling = [r for r in request_ids if self._structured is not None and self._structured.abort(r)]
        return [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT)
                for r in compiling] + self.scheduler.abort_requests(request_ids)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.waves is not None:
            stats.num_dummy_steps = self.waves.dummy_steps
        return stats

    def call_utility(self, method: str, args: list) -> Any:
        """Run one of the utilities this engine allows by name (never an arbitrary attribute); errors raise."""
        if method in (PROFILER_METHODS | CACHE_RESET_METHODS) - self._privileged_utilities():
            switch = "profiler_dir (--profiler-dir DIR, or PAGEDSERVE_TORCH_PROFILER_DIR=DIR for LLM/AsyncLLM)" \
                if method in PROFILER_METHODS else \
                "enable_cache_reset (--enable-cache-reset)"
            raise PermissionError(f"{method} is not allowed on this engine; it is enabled at start-up by {switch}")
        if method not in UTILITY_METHODS | self._privileged_utilities():
            raise ValueError(f"unknown utility method {method!r}; known: "
                             f"{sorted(UTILITY_METHODS | PROFILER_METHODS | CACHE_RESET_METHODS)}")
        return getattr(self, method)(*args)

    def _privileged_utilities(self) -> frozenset[str]:
        return (PROFILER_METHODS if self.profiler is not None else frozenset()) | (
            CACHE_RESET_METHODS if self.config.enable_cache_reset else frozenset())

    def get_info(self) -> EngineInfo:
        return self.info

    def check_lora(self, name: str, int_id: int, path: str) -> bool:
        """Read and check an adapter as a request naming it would (ValueError saying what is wrong with it)."""
        if self.lora_validator is None:
            raise ValueError("this engine serves no LoRA adapters (--enable-lora)")
        self.lora_validator.check(msgspec.convert({"lora_name": name, "lora_int_id": int_id, "lora_path": path},
                                                  LoRARequest))
        return True

    def check_health(self) -> bool:
        """True, or the executor's error naming the worker rank that failed."""
        self.executor.check_health()
        return True

    def start_profile(self) -> str:
        """Start the profiler; returns profiler_dir, where the trace will go."""
        return self.profiler.start()

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so later requests compute their prompts in full (e.g. after new weights)."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests to run or compiling their grammar, or batches still executing (whose outputs must be collected
        even if all aborted)."""
        return (self.scheduler.has_unfinished_requests() or bool(self.scheduler.in_flight)
                or (self._structured is not None and bool(self._structured.pending)))

    def step(self) -> list[EngineCoreOutput]:
        """Keep the executor's batches in flight (pp of them under pipeline parallelism, else one), then collect
        the oldest one's new tokens (finished requests carry a finish_reason)."""
        outputs = self._admit_compiled()
        self._fill_pipeline()
        if self.profiler is not None:
            self.profiler.on_step()
        if not self.scheduler.in_flight:
            if self._structured is not None:
                self._structured.wait(_IDLE_WAIT_S)  # nothing to run until a grammar is ready
            if self.scheduler.connector is not None:
                self.scheduler.connector.wait(_IDLE_WAIT_S)  # or until a request's KV arrives
            return outputs
        return outputs + self.scheduler.update_from_output(self.executor.collect_output())

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Constrained requests whose grammar is ready join the scheduler; failed or late ones end with an error."""
        if self._structured is None or not self._structured.pending:
            return []
        ready, failed = self._structured.admit()
        for request in ready:
            self.scheduler.add_request(request)
        return failed

    def _fill_pipeline(self) -> None:
        """A request in flight has no token to compute until its batch returns, so each batch holds other
        requests (or later prompt chunks, which every stage runs after the earlier ones)."""
        depth = self.executor.max_concurrent_batches
        while len(self.scheduler.in_flight) < depth and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens == 0:
                return
            grammars = None
            if self._structured is not None:
                scheduler_output.grammar_bitmask = self._structured.bitmask(scheduler_output, self.scheduler.requests)
                if scheduler_output.num_steps > 1 and scheduler_output.grammar_bitmask is not None:
                    grammars = {req_id: self.scheduler.requests[req_id].grammar
                                for req_id in scheduler_output.grammar_bitmask.req_ids}
            self.executor.submit_batch(scheduler_output, grammars)
            self.batches_submitted += 1

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.close()
        self.executor.shutdown()


def _make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; Ray actors for tp * pp > 1 or a Ray data-parallel engine (imported here, so Ray
    stays optional)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1 and config.data_parallel_backend != "ray":
        return InProcessExecutor(config)
    from workers.ray_executor import RayExecutor

    return RayExecutor(config)
