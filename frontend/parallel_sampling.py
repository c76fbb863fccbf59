"""Parallel sampling (n > 1): one engine request per sample; their prompt blocks are shared by the prefix cache."""
from __future__ import annotations

import msgspec

from frontend.outputs import RequestOutput
from ipc import SamplingParams
from ipc.bounds import INT64_MAX


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of n: n=1, and a seed of its own (seed + index) so the n samples differ reproducibly."""
    seed = None if params.seed is None else params.seed + index
    if seed is not None and seed > INT64_MAX:  # wrap within SamplingParams' 64-bit range
        seed -= 2**64
    return msgspec.structs.replace(params, n=1, seed=seed)


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def merge_samples(parent_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """The n samples' final outputs as one RequestOutput with n CompletionOutputs, indexed 0..n-1."""
    first = samples[0]
    completions = []
    for index, sample in enumerate(samples):
        completion = sample.outputs[0]
        completion.index = index
        completions.append(completion)
    return RequestOutput(parent_id, first.prompt, first.prompt_token_ids, completions,
                         all(s.finished for s in samples), first.num_cached_tokens, first.prompt_logprobs)
