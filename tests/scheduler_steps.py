"""Scheduler tests' requests, schedulers and steps (a pretended model that samples one token)."""
from __future__ import annotations

from core.kv_cache_manager import KVCacheManager
from core.request import Request
from core.scheduler import Scheduler
from ipc import EngineConfig, EngineCoreRequest, ModelRunnerOutput, SamplingParams


def make_request(i: int, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Request:
    core = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(range(prompt_len)),
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             priority=priority)
    return Request(core, arrival_index=i, max_tokens=max_tokens)


def make_scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, max_model_len=config.pop("max_model_len", 256),
                          **config)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, then pretend the model sampled `token` for every request that reached its end."""
    out = scheduler.schedule()
    done = {r.request_id: [token] for r in scheduler.running if r.num_computed_tokens == r.num_tokens
            and r.request_id in out.num_scheduled_tokens}
    return out, scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids=done))
