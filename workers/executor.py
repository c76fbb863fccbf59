"""Executors drive the workers: the in-process one (tp = pp = 1) calls a single Worker directly; the Ray one
(workers/ray_executor.py) drives tp × pp ranks."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from ipc import EngineConfig, ModelRunnerOutput, SchedulerOutput
from workers.distributed import set_expert_group
from workers.expert_group import join_group
from workers.gpu_memory import release_device_memory
from workers.kv_transfer_endpoint import TransferEndpoint
from workers.fast_path.step_grammars import LentGrammars
from workers.worker import Worker


class Executor(Protocol):
    """Batches are submitted and their outputs collected in order; up to max_concurrent_batches at once."""

    max_concurrent_batches: int

    def determine_num_kv_blocks(self) -> int: ...

    def weight_bytes(self) -> int: ...

    def num_host_blocks(self) -> int:
        """The prefix cache's host-tier blocks every rank holds (kv_offload_bytes; 0 without a tier)."""

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def decodes_ahead(self) -> bool:
        """Whether the workers run decode steps' forward passes ahead (SchedulerOutput.decode_ahead)."""

    def multi_steps(self) -> int:
        """The most greedy decode steps one call of the workers runs (SchedulerOutput.num_steps)."""

    def steps_grammars(self) -> bool:
        """Whether constrained requests take part in multi-step calls: the workers take the engine core's matchers
        (submit_batch's grammars), which only a worker in the engine core's process can."""

    def submit_batch(self, scheduler_output: SchedulerOutput,
                     grammars: LentGrammars | None = None) -> None:
        """grammars: the matchers of the constrained requests of a multi-step call, where steps_grammars()."""

    def collect_output(self) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_ep_address is not None:  # before the model is built: it decides the experts held
            set_expert_group(join_group(config.data_parallel_ep_address, "experts", config.data_parallel_rank,
                                        config.data_parallel_size))
        self.worker = Worker(config)
        self.outputs: deque[ModelRunnerOutput] = deque()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def num_host_blocks(self) -> int:
        return self.worker.num_host_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def decodes_ahead(self) -> bool:
        return self.worker.model_runner.decodes_ahead

    def multi_steps(self) -> int:
        return self.worker.model_runner.multi_steps

    def steps_grammars(self) -> bool:
        return True

    def submit_batch(self, scheduler_output: SchedulerOutput,
                     grammars: LentGrammars | None = None) -> None:
        """Runs the step right away: one process computes one batch at a time."""
        self.outputs.append(self.worker.execute_model(scheduler_output, grammars))

    def collect_output(self) -> ModelRunnerOutput:
        return self.outputs.popleft()

    def kv_transfer_endpoint(self) -> TransferEndpoint | None:
        """Disaggregated prefill's worker half, which the engine core's connector calls between steps."""
        return self.worker.kv_transfer

    def check_health(self) -> None:
        """Nothing here can fail apart from this process itself."""

    def shutdown(self) -> None:
        """The model, its KV cache and CUDA graphs freed now, not when the LLM is collected: the process can start
        another engine on the same GPU straight after (the Ray executor tears down its actors here)."""
        device = self.worker.device
        del self.worker
        set_expert_group(None)
        release_device_memory(device)
