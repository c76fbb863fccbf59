"""EngineCore: validates requests, owns the scheduler and KV cache manager, and runs one step at a time."""
from __future__ import annotations

import itertools

import msgspec

from core.kv_cache_manager import KVCacheManager
from core.request import Request, RequestStatus
from core.scheduler import Scheduler
from ipc import EngineConfig, EngineCoreOutput, EngineCoreRequest
from workers.executor import InProcessExecutor
from workers.model_config import load_hf_config, model_max_len


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        hf_config = load_hf_config(config.model)
        self.config = _resolve_max_model_len(config, model_max_len(hf_config))
        self.vocab_size: int = hf_config.vocab_size
        self.executor = InProcessExecutor(self.config)
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        _check_capacity(self.config, self.num_kv_blocks)
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.kv_cache_manager)
        self._arrivals = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError naming what is wrong; nothing is queued."""
        prompt, limit = request.prompt_token_ids, self.config.max_model_len
        if not prompt:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if len(prompt) >= limit:
            raise ValueError(f"request {request.request_id}: the prompt has {len(prompt)} tokens, but "
                             f"max_model_len is {limit} (prompt tokens must be fewer, to leave room to generate)")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"request {request.request_id}: prompt token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if request.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"request {request.request_id}: priority={request.priority} needs "
                             "scheduling_policy='priority' (the engine runs first-come first-served)")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate_request(request)
        room = self.config.max_model_len - len(request.prompt_token_ids)
        max_tokens = min(request.sampling_params.max_tokens or room, room)
        self.scheduler.add_request(Request(request, next(self._arrivals), max_tokens))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, and return this step's new tokens (finished requests carry a finish_reason)."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _resolve_max_model_len(config: EngineConfig, model_limit: int) -> EngineConfig:
    if config.max_model_len is None:
        return msgspec.structs.replace(config, max_model_len=model_limit)
    if config.max_model_len > model_limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's maximum length "
                         f"{model_limit} (max_position_embeddings)")
    return config


def _check_capacity(config: EngineConfig, num_blocks: int) -> None:
    capacity = num_blocks * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer "
                         f"than max_model_len={config.max_model_len}; raise kv_cache_memory/num_kv_blocks "
                         "or lower max_model_len")
