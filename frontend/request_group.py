"""RequestGroup: one user request in the front end — its n samples as engine requests (child ids, seeds), their
outputs merged into the request's own, and exactly one final output or error."""
from __future__ import annotations

from collections.abc import Callable

import msgspec

from frontend.outputs import CompletionOutput, RequestOutput
from ipc import RequestOutputKind, SamplingParams
from ipc.bounds import INT64_MAX

# Where a group hands its outputs: each RequestOutput (its CompletionOutputs carry their sample's index), or the
# error that ends the request. Called on the front end's output path: must not block or raise.
OutputCallback = Callable[[RequestOutput | Exception], None]


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The id of part `index` of n of a request: a sample's engine request, or a prompt's group in a request of
    several prompts (the request's own id when n == 1)."""
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of n: n=1, and a seed of its own (seed + index) so the n samples differ reproducibly."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    if seed is not None and seed > INT64_MAX:  # wrap within SamplingParams' 64-bit range
        seed -= 2**64
    return msgspec.structs.replace(params, n=1, seed=seed)


class RequestGroup:
    """The engine requests behind one user request and how their outputs become the request's. Streaming kinds
    (DELTA, CUMULATIVE) pass each sample's output on, marked with its index, finished only once all n are;
    FINAL_ONLY gives one output holding all n samples. After the final output or an error, nothing more."""

    __slots__ = ("request_id", "n", "output_kind", "on_output", "child_ids", "finals", "num_finished", "done")

    def __init__(self, request_id: str, params: SamplingParams, on_output: OutputCallback) -> None:
        self.request_id, self.n, self.output_kind, self.on_output = request_id, params.n, params.output_kind, on_output
        self.child_ids = [child_request_id(request_id, index, params.n) for index in range(params.n)]
        self.finals: list[CompletionOutput | None] = [None] * params.n
        self.num_finished = 0
        self.done = False

    def child_output(self, index: int, output: RequestOutput) -> None:
        """Take sample `index`'s output (its request's last if output.finished) and pass on what it adds."""
        if self.done:
            return
        completion = output.outputs[0]
        if output.finished:
            self.finals[index] = completion
            self.num_finished += 1
        if self.n > 1:
            completion.index, output.request_id = index, self.request_id
            output.finished = self.num_finished == self.n
            if self.output_kind == RequestOutputKind.FINAL_ONLY:
                if not output.finished:
                    return
                output.outputs = list(self.finals)
        self.done = output.finished
        self.on_output(output)

    def fail(self, error: Exception) -> None:
        """End the request with `error` (unless it has already ended)."""
        if not self.done:
            self.done = True
            self.on_output(error)


class FinalOutputs:
    """The final outputs of several requests, by position; the first error is kept and ends the wait."""

    def __init__(self, count: int, on_end: Callable[[], None] | None = None) -> None:
        self.outputs: list[RequestOutput | None] = [None] * count
        self.remaining = count
        self.error: Exception | None = None
        self.on_end = on_end

    @property
    def ended(self) -> bool:
        return self.remaining == 0 or self.error is not None

    def callback(self, position: int) -> OutputCallback:
        """The OutputCallback of the request at `position` (its group gives it only its final output or error)."""
        def put(item: RequestOutput | Exception) -> None:
            if self.ended:
                return
            if isinstance(item, Exception):
                self.error = item
            else:
                self.outputs[position] = item
                self.remaining -= 1
            if self.ended and self.on_end is not None:
                self.on_end()
        return put
