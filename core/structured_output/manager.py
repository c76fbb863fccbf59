"""The engine core's structured output: requests wait off the scheduler until their grammar compiles (or fails, or
times out), then each holds a matcher that its sampled tokens advance and that fills its row of the step's mask."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np

from core.request import Request
from core.structured_output.backends import CompiledConstraint, RequestGrammar
from core.structured_output.compiler import GrammarCompiler
from core.structured_output.reasoning import ReasoningGate
from ipc import EngineCoreOutput, FinishReason, GrammarBitmask, SchedulerOutput

logger = logging.getLogger("pagedserve.structured_output")


@dataclass
class _Pending:
    request: Request
    future: Future
    added: float


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str, vocab_size: int, compile_timeout_s: float, compile_memory_mb: int,
                 cache_bytes: int) -> None:
        self.compiler = GrammarCompiler(tokenizer_dir, vocab_size, compile_timeout_s, compile_memory_mb, cache_bytes)
        self.words_per_row = (vocab_size + 31) // 32
        self.compile_timeout_s = compile_timeout_s
        self.pending: dict[str, _Pending] = {}

    def add(self, request: Request) -> None:
        """Start compiling the request's constraint; it joins the scheduler once `admit` finds it compiled."""
        future = self.compiler.compile(request.sampling_params.structured_outputs)
        self.pending[request.request_id] = _Pending(request, future, time.monotonic())

    def abort(self, request_id: str) -> bool:
        """Forget a request still waiting for its grammar; False if it is not waiting."""
        return self._forget(request_id)

    def _forget(self, request_id: str) -> bool:
        """Drop a waiting request; its compile is stopped if no other request waits for it."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return False
        if all(other.future is not pending.future for other in self.pending.values()):
            self.compiler.give_up(pending.request.sampling_params.structured_outputs, pending.future)
        return True

    def _deadline(self, pending: _Pending) -> float:
        """When its compile times out: the timeout counts from when it came, or from when the vocabulary tables were
        ready if that was later (never while they are built)."""
        ready_at = self.compiler.tables_ready_at
        return float("inf") if ready_at is None else max(pending.added, ready_at) + self.compile_timeout_s

    def wait(self, timeout_s: float) -> None:
        """Block until a pending compile finishes, or a deadline or `timeout_s` passes (nothing else to run)."""
        if self.pending:
            until_deadline = min(self._deadline(p) for p in self.pending.values()) - time.monotonic()
            wait([p.future for p in self.pending.values()], timeout=max(0.0, min(timeout_s, until_deadline)),
                 return_when=FIRST_COMPLETED)

    def admit(self) -> tuple[list[Request], list[EngineCoreOutput]]:
        """(requests whose grammar is ready, with their matcher attached; final outputs of those that failed)."""
        ready, failed, now = [], [], time.monotonic()
        for request_id, pending in list(self.pending.items()):
            if pending.future.done():
                del self.pending[request_id]
                error = pending.future.exception()
                if error is None:
                    pending.request.grammar = _matcher(pending.request, pending.future.result())
                    ready.append(pending.request)
                elif isinstance(error, ValueError):  # the constraint's own fault: the backend's message, a 400
                    failed.append(_ended(request_id, str(error), "invalid"))
                else:  # a backend bug on this constraint: a 500 for this request alone
                    failed.append(_ended(request_id, f"compiling structured_outputs failed: "
                                         f"{type(error).__name__}: {error}", "failed"))
            elif now >= self._deadline(pending):
                self._forget(request_id)
                kind = pending.request.sampling_params.structured_outputs.kind
                failed.append(_ended(request_id, f"structured_outputs.{kind} took longer than "
                                     f"{self.compile_timeout_s:g} s to compile (--structured-outputs-compile-timeout)",
                                     "invalid"))
        return ready, failed

    def bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """Rows for the constrained requests that sample in this step (their scheduled tokens reach the end)."""
        sampling = [request for req_id in scheduler_output.num_scheduled_tokens
                    if (request := requests[req_id]).grammar is not None
                    and request.num_computed_tokens == request.num_tokens]
        if not sampling:
            return None
        rows = np.zeros((len(sampling), self.words_per_row), dtype=np.int32)
        for row, request in enumerate(sampling):
            try:
                request.grammar.fill(rows, row)
            except Exception as error:  # this request fails when its token comes back; the engine serves on
                logger.exception("filling the token mask of request %s failed", request.request_id)
                rows[row] = -1  # every token allowed for this one step
                request.grammar_error = f"structured output failed: {type(error).__name__}: {error}"
        return GrammarBitmask(req_ids=[r.request_id for r in sampling], words_per_row=self.words_per_row,
                              packed=rows.astype("<i4", copy=False).tobytes())

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _matcher(request: Request, compiled: CompiledConstraint) -> RequestGrammar:
    """The request's matcher, behind its reasoning section when it has one."""
    matcher = compiled.matcher(_stop_tokens(request))
    section = request.sampling_params.structured_outputs.reasoning
    return matcher if section is None else ReasoningGate(matcher, section)


def _stop_tokens(request: Request) -> list[int]:
    stops = list(request.sampling_params.stop_token_ids or ())
    return stops + [request.eos_token_id] if request.eos_token_id is not None else stops


def _ended(request_id: str, message: str, kind: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=message,
                            error_kind=kind, error_param="structured_outputs" if kind == "invalid" else None)
