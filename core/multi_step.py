"""Multi-step decoding: how many greedy decode steps a decode-only batch runs in one worker call.

At batch-1 decode on a CPU the scheduling, input preparation, sampling set-up and output handling of a step cost
about a third of the step beside the weights' streaming; a worker call that runs several steps back to back pays
them once. Only where the tokens in between need nothing but argmax, and where nobody waits to join the batch."""
from __future__ import annotations

from core.request import Request


def plain_greedy(request: Request) -> bool:
    """Whether its next tokens are the model's argmax and nothing else: greedy, no logprobs, penalties, bias, bans,
    grammar or adapter, and min_tokens reached (its stop tokens are no longer banned)."""
    params = request.sampling_params
    return (params.is_greedy and params.logprobs is None and not params.has_penalties and not params.logit_bias
            and not params.bad_words_token_ids and params.structured_outputs is None and request.grammar is None
            and request.lora_request is None and request.pooling_params is None
            and len(request.output_token_ids) >= params.min_tokens)


def num_steps(requests: list[Request], limit: int, max_model_len: int) -> int:
    """Decode steps these requests (each scheduled for one token) can run in one call: at most `limit`, none past
    a request's max_tokens or max_model_len; 1 where any of them is not plain greedy."""
    if not all(plain_greedy(r) for r in requests):
        return 1
    room = min(min(r.max_tokens - len(r.output_token_ids), max_model_len - r.num_tokens) for r in requests)
    return max(1, min(limit, room))
