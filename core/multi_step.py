"""Multi-step decoding: how many decode steps a decode-only batch runs in one worker call.

At batch-1 decode on a CPU the scheduling, input preparation, sampling set-up and output handling of a step cost
about a third of the step beside the weights' streaming, and at 64 sampled requests a tenth; a worker call that runs
several steps back to back pays the scheduler's share once. Only where the tokens in between need nothing from the
scheduler, and where nobody waits to join the batch. How many: as many as fit a time budget, by the measured time
of recent decode steps of about that batch size (StepTimes)."""
from __future__ import annotations

from core.request import Request
from ipc.sampling_params import tokens_left

# Steps of a call whose batch size has no timing yet: enough to time a step, few enough that a slow model's first
# call does not hold its tokens back for long.
UNTIMED_STEPS = 2


def decodes_alone(request: Request, grammars: bool) -> bool:
    """Whether the worker can take its next tokens without the scheduler: greedy or sampled (penalties, bias and bans
    apply over the call's tokens too; logprobs are gathered at each step; an adapter's deltas at each step), a
    grammar's only where the worker takes the matchers (`grammars`: it follows a fork of the request's), no pooling,
    and min_tokens reached (its stop tokens are no longer banned)."""
    params = request.sampling_params
    return ((grammars or (params.structured_outputs is None and request.grammar is None))
            and request.pooling_params is None and len(request.output_token_ids) >= params.min_tokens)


def num_steps(requests: list[Request], limit: int, max_model_len: int, grammars: bool = False) -> int:
    """Decode steps these requests (each scheduled for one token) can run in one call: at most `limit`, none past
    a request's max_tokens or max_model_len; 1 where any of them needs the scheduler between steps (grammars:
    whether the worker takes constrained requests' matchers)."""
    if not all(decodes_alone(r, grammars) for r in requests):
        return 1
    room = min(tokens_left(r.max_tokens, len(r.output_token_ids), max_model_len, r.num_tokens) for r in requests)
    return max(1, min(limit, room))


class StepTimes:
    """Seconds per decode step by batch size (each power-of-two range apart), from the engine's decode-only calls:
    how many steps of a multi-step call fit its time budget. The budget bounds how long a call's tokens are held
    back from their streams and a new request waits to join: with a fixed step count, a model taking 0.6 s a step
    on a CPU would stream bursts of 5 s at 8 steps, while a tiny one pays the call's fixed cost every 8 steps of
    80 us."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self._per_step: dict[int, float] = {}

    def limit(self, batch: int, most: int) -> int:
        """Steps for a call of `batch` requests: at most `most`, within the budget (without one: `most`)."""
        if self.budget_s is None:
            return most
        seconds = self._per_step.get(batch.bit_length())
        if seconds is None:
            return min(most, UNTIMED_STEPS)
        return max(1, min(most, int(self.budget_s / seconds)))

    def observe(self, batch: int, steps: int, seconds: float) -> None:
        """A decode-only call of `batch` requests ran `steps` steps in `seconds` (scheduled to outputs back)."""
        per_step, bucket = seconds / steps, batch.bit_length()
        before = self._per_step.get(bucket)
        self._per_step[bucket] = per_step if before is None else (before + per_step) / 2
