"""Multi-step decoding: how many decode steps a decode-only batch runs in one worker call.

At batch-1 decode on a CPU the scheduling, input preparation, sampling set-up and output handling of a step cost
about a third of the step beside the weights' streaming, and at 64 sampled requests a tenth; a worker call that runs
several steps back to back pays the scheduler's share once. Only where the tokens in between need nothing from the
scheduler, and where nobody waits to join the batch."""
from __future__ import annotations

from core.request import Request


def decodes_alone(request: Request) -> bool:
    """Whether the worker can take its next tokens without the scheduler: greedy or sampled (penalties, bias and bans
    apply over the call's tokens too), but no grammar (its bitmask follows each token), logprobs, adapter or pooling,
    and min_tokens reached (its stop tokens are no longer banned)."""
    params = request.sampling_params
    return (params.logprobs is None and params.structured_outputs is None and request.grammar is None
            and request.lora_request is None and request.pooling_params is None
            and len(request.output_token_ids) >= params.min_tokens)


def num_steps(requests: list[Request], limit: int, max_model_len: int) -> int:
    """Decode steps these requests (each scheduled for one token) can run in one call: at most `limit`, none past
    a request's max_tokens or max_model_len; 1 where any of them needs the scheduler between steps."""
    if not all(decodes_alone(r) for r in requests):
        return 1
    room = min(min(r.max_tokens - len(r.output_token_ids), max_model_len - r.num_tokens) for r in requests)
    return max(1, min(limit, room))
