"""What the scheduler does with a step's output (tokens appended, drafts counted, requests stopped or failed) and how
a request ends, from a step or by an abort."""
from __future__ import annotations

import heapq
import logging
import time

from core.request import Request, RequestStatus
from ipc import EngineCoreOutput, FinishReason, ModelRunnerOutput

logger = logging.getLogger("pagedserve.scheduler")


class StepOutputs:
    """The Scheduler's half that takes each batch's output back and ends requests (mixed into
    core.scheduler.Scheduler, whose state it reads and changes: in_flight, requests, running, waiting, kv,
    spec_stats, step_times, max_model_len, finished_req_ids, connector)."""

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """For the oldest batch in flight: append sampled tokens, finish requests that stop, report new tokens."""
        scheduled, decode_call = self.in_flight.popleft(), self._decode_calls.popleft()
        for req_id, chunk in runner_output.prompt_logprobs.items():
            if (request := self._still_current(scheduled, req_id)) is not None:
                request.add_prompt_logprobs(chunk)
        outputs = [self._fail(request, message) for req_id, message in runner_output.failed.items()
                   if (request := self._still_current(scheduled, req_id)) is not None]
        for req_id, pooled in runner_output.pooled.items():
            if (request := self._still_current(scheduled, req_id)) is not None:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=FinishReason.STOP,
                                                num_cached_tokens=request.num_cached_tokens, pooled=pooled))
        for req_id, token_ids in runner_output.sampled_token_ids.items():
            request = self._still_current(scheduled, req_id)
            if request is None:
                continue
            self._count_computed(request, token_ids, runner_output.verified.get(req_id, ()))
            output = self._append_tokens(request, token_ids, runner_output)
            if request.status == RequestStatus.RUNNING:
                request.spec_token_ids = runner_output.draft_token_ids.get(req_id, [])
            outputs.append(output)
        if decode_call is not None and any(request.status == RequestStatus.RUNNING for request, _ in
                                           scheduled.values()):  # one goes on: the call ran all its steps
            started, steps, batch = decode_call
            self.step_times.observe(batch, steps, time.perf_counter() - started)
        return outputs

    def _count_computed(self, request: Request, token_ids: list[int], verified: list[tuple[int, int]]) -> None:
        """The step computed the K/V of each token it sampled but the last (a multi-step call's steps, accepted
        drafts); its scheduled drafts were counted computed when scheduled. Rejected drafts' slots hold no token:
        they are computed again (the blocks stay, as the next step's drafts fill them). verified: each verification
        of the step (drafted, accepted)."""
        drafts, request.scheduled_spec_token_ids = request.scheduled_spec_token_ids, []
        request.num_computed_tokens += len(token_ids) - 1 - len(drafts)
        for num_drafted, num_accepted in verified:
            self.spec_stats.observe(num_drafted, num_accepted)

    def _append_tokens(self, request: Request, token_ids: list[int], runner_output: ModelRunnerOutput
                       ) -> EngineCoreOutput:
        """Append the step's tokens one by one; those after one that finishes the request are dropped."""
        for count, token_id in enumerate(token_ids, start=1):
            request.append_output_token(token_id)
            if request.grammar is not None and (error := _advance_grammar(request, token_id)) is not None:
                return self._fail(request, *error)
            stopped = request.check_stop(self.max_model_len)
            if stopped is not None:
                self._finish(request, stopped)
                break
        return self._output(request, token_ids[:count], runner_output)

    def _still_current(self, scheduled: dict[str, tuple[Request, int]], req_id: str) -> Request | None:
        """The request this output was computed for, unless it was aborted, finished or preempted since."""
        request, num_preemptions = scheduled[req_id]
        if self.requests.get(req_id) is not request or request.num_preemptions != num_preemptions:
            return None
        return request if request.status == RequestStatus.RUNNING else None

    def _output(self, request: Request, token_ids: list[int], runner_output: ModelRunnerOutput) -> EngineCoreOutput:
        req_id = request.request_id
        output = EngineCoreOutput(request_id=req_id, new_token_ids=token_ids,
                                  finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                  num_cached_tokens=request.num_cached_tokens,
                                  prompt_logprobs=request.pending_prompt_logprobs, kv_transfer_params=request.kv_sent)
        request.pending_prompt_logprobs = None
        if req_id in runner_output.logprobs:
            count = len(token_ids)
            output.new_logprob_token_ids = runner_output.logprob_token_ids[req_id][:count]
            output.new_logprobs = runner_output.logprobs[req_id][:count]
            output.new_sampled_ranks = runner_output.sampled_ranks[req_id][:count]
        return output

    def _fail(self, request: Request, message: str, kind: str = "failed") -> EngineCoreOutput:
        """End a request the workers could not prepare or sample (kind "invalid": its output constraint's fault); its
        blocks go back to the pool."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                error=message, error_kind=kind,
                                error_param="structured_outputs" if kind == "invalid" else None)

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort from outside the step; unknown or finished ids are ignored. One final output per abort."""
        outputs = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self.num_aborted_requests += 1
                outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                finish_reason=FinishReason.ABORT))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting = [(key, r) for key, r in self.waiting if r is not request]
            heapq.heapify(self.waiting)
        if self.connector is not None:
            self.connector.forget(request)  # its KV, if still arriving
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                request.kv_sent = self.connector.send(request)  # its blocks still hold the prompt's KV
        request.set_status(status)
        self.kv.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)


def _advance_grammar(request: Request, token_id: int) -> tuple[str, str] | None:
    """Feed the sampled token to the request's matcher; (why the request must fail, the error's kind) if it must."""
    if request.grammar_error is not None:
        return request.grammar_error, "failed"
    try:
        if request.grammar.accept(token_id):
            return None
    except Exception as error:  # a backend bug fails this request alone
        logger.exception("advancing the grammar of request %s failed", request.request_id)
        return f"structured output failed: {type(error).__name__}: {error}", "failed"
    # The mask allowed no token: the constraint leads nowhere from here (a $ref or rule cycle with no way out), or
    # the request's bad_words took away every token it allowed. Either way the request's own parameters.
    return (f"token {token_id} breaks the request's structured_outputs constraint: it allows no token after "
            f"{len(request.output_token_ids) - 1} tokens of output (a $ref or rule cycle with no way out, or "
            "bad_words that take away every token it allows)"), "invalid"
