"""Waves: data-parallel engines whose experts are split across them step in lockstep while any has work.

Each MoE layer exchanges tokens with every engine (workers/expert_group.py), so every engine must run the same
number of forward passes. Before each step the engines exchange an "any work" flag and their step counts; while any
engine has work (a wave is live) every engine steps, one with nothing to run stepping a dummy batch (no tokens:
through the MoE layers' exchanges only). When no engine has work the wave ends for all at once, and each waits for
input WAVE_POLL_S at a time between exchanges, so an engine that receives a request starts the next wave for all
within that time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ipc import EngineConfig, EngineCoreOutput, SchedulerOutput
from workers.expert_group import EngineGroup, any_work, join_group

if TYPE_CHECKING:
    from core.engine_core import EngineCore

WAVE_POLL_S = 0.05
_DUMMY_BATCH = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                               total_num_scheduled_tokens=0, finished_req_ids=[])


def check_waves_config(config: EngineConfig) -> None:
    """What data parallel with expert parallel cannot run yet (ValueError naming it)."""
    if config.data_parallel_ep_address is None:
        return
    host, _, port = config.data_parallel_ep_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"data_parallel_ep_address must be HOST:PORT, got {config.data_parallel_ep_address!r}")
    if config.data_parallel_rank >= config.data_parallel_size:
        raise ValueError(f"data_parallel_rank must be below data_parallel_size ({config.data_parallel_size}), got "
                         f"{config.data_parallel_rank}")
    if config.pipeline_parallel_size > 1 or config.data_parallel_backend == "ray":
        raise ValueError("enable_expert_parallel with data_parallel_size > 1 runs the engines' ranks on this machine, "
                         "one pipeline stage each: pipeline_parallel_size must be 1 and data_parallel_backend 'mp'")
    if config.speculative_config is not None:
        raise ValueError("enable_expert_parallel with data_parallel_size > 1 takes no speculative_config: a draft's "
                         "forward passes would not match the other engines'")


class Waves:
    """This engine's side of the waves: the flag exchange and the step (its own batch, or the dummy batch)."""

    def __init__(self, group: EngineGroup) -> None:
        self.group = group
        self.live = False
        self.steps = 0  # steps of every wave, which every engine counts alike
        self.dummy_steps = 0  # of those, steps this engine had nothing to run in

    @classmethod
    def join(cls, config: EngineConfig) -> Waves:
        """Meet the other engine processes (before any engine's ranks meet in the experts' group)."""
        return cls(join_group(config.data_parallel_ep_address, "waves", config.data_parallel_rank,
                              config.data_parallel_size, serve=config.data_parallel_rank == 0))

    def next_step(self, engine: EngineCore) -> bool:
        """Whether the engines step now: the same answer on every engine."""
        self.live = any_work(self.group, engine.has_unfinished_requests(), self.steps)
        return self.live

    def step(self, engine: EngineCore) -> list[EngineCoreOutput]:
        """One step of a live wave: exactly one forward pass, the engine's own batch or the dummy batch."""
        self.steps += 1
        submitted = engine.batches_submitted
        outputs = engine.step() if engine.has_unfinished_requests() else []
        if engine.batches_submitted == submitted:  # nothing scheduled (idle, or every request blocked this step)
            engine.executor.submit_batch(_DUMMY_BATCH)
            engine.executor.collect_output()
            self.dummy_steps += 1
        return outputs
