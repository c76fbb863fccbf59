"""The step with the largest activations, run once on a throwaway KV cache for the memory profile."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ipc import NewRequestData, SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

# The memory profile samples with the costliest options (a sort over the vocabulary for each row).
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)


def profile_step(runner: ModelRunner) -> None:
    """The step with the largest activations, for the memory profile: max_num_batched_tokens prompt tokens
    over as many sequences as one step may sample (none longer than max_model_len), then sampling, on a
    throwaway KV cache just large enough. Leaves no request, cache or sampler state behind."""
    config = runner.config
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    num_tokens = min(config.max_num_batched_tokens, num_seqs * config.max_model_len)
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    # Slots for the drafts a draft model writes after the sampled token: its steps are profiled too.
    drafted = config.speculative_config.num_speculative_tokens if runner.speculator is not None else 0
    blocks = [-(-(length + drafted) // runner.block_size) for length in lengths]
    first_blocks = [0, *itertools.accumulate(blocks)]
    requests = [NewRequestData(req_id=f"profile-{i}", prompt_token_ids=[0] * length,
                               sampling_params=_PROFILE_SAMPLING, eos_token_id=None,
                               block_ids=list(range(first_blocks[i], first_blocks[i + 1])), num_computed_tokens=0)
                for i, length in enumerate(lengths)]
    runner.bind_kv_cache(first_blocks[-1])
    try:
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=requests, scheduled_cached_reqs=[], finished_req_ids=[],
            num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in requests},
            total_num_scheduled_tokens=num_tokens))
    finally:
        if runner.speculator is not None:
            for request in requests:
                runner.speculator.forget(request.req_id)
        runner.requests.clear()
        runner.release_kv_cache()
        runner.sampler.generator.manual_seed(config.seed)

