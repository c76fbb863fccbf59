"""Scheduler: gives each request tokens to compute under the step's budget; preempts by recompute."""
from __future__ import annotations

import bisect
import heapq
import time
from collections import deque

from core import multi_step
from core.multi_step import StepTimes
from core.encoder_budget import chunk_within_encoder_budget, count_encoded
from core.kv_cache_manager import KVCacheManager
from core.kv_transfer import KVConnector
from core.request import Request, RequestStatus
from core.scheduler_outputs import StepOutputs
from core.scheduler_stats import SchedulerCounters
from ipc.sampling_params import tokens_left
from ipc import (
    CachedRequestData,
    EngineConfig,
    NewRequestData,
    SchedulerOutput,
    SpecDecodingStats,
)


class Scheduler(StepOutputs, SchedulerCounters):
    """No prefill or decode phases: each request computes `num_tokens - num_computed_tokens` tokens, capped."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, whole_prompts: bool = False,
                 decode_ahead: bool = False, multi_step: int = 1, multi_step_grammars: bool = False) -> None:
        """whole_prompts: an encoder-only model's engine; each request runs whole in one step and holds no KV
        blocks (its attention sees only that step's tokens). decode_ahead: the worker runs a decode step's
        forward pass ahead (SchedulerOutput.decode_ahead), so each decode holds the slot of its next token too.
        multi_step: the most decode steps the worker runs in one call (core/multi_step.py), each verifying
        drafts where speculative decoding proposes them; the decodes of such a call hold the slots of all its
        tokens; with multi_step_grammars constrained requests take part (the worker follows their matchers)."""
        self.whole_prompts = whole_prompts
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_encoder_tokens = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        self.encoder_budget = self.max_encoder_tokens  # what the step being scheduled has left
        self.max_model_len = config.max_model_len
        self.max_loras = config.max_loras  # distinct LoRA adapters among the running requests
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        # Kept sorted by sort_key, so the preemption victim is always the last one (never one already
        # scheduled in this step, since running requests are scheduled front to back).
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []  # not yet told to the workers
        # One entry per batch still executing, oldest first: who was scheduled, at which preemption count.
        # With pipeline batches in flight, a request may be preempted (and even rescheduled, or replaced by a
        # new request with its id) before an older batch's output comes back; that output is then stale.
        self.in_flight: deque[dict[str, tuple[Request, int]]] = deque()
        self.num_preemptions = 0
        self.num_aborted_requests = 0
        self.peak_kv_usage = 0.0
        self.kv_utilization_at_peak = 1.0
        self.peak_num_running = 0
        self.speculative_config = config.speculative_config
        self.spec_stats = SpecDecodingStats() if config.speculative_config is not None else None
        self.num_lookahead_slots = config.speculative_config.num_lookahead_slots if self.spec_stats else 0
        self.decode_ahead = decode_ahead
        self.multi_step, self.multi_step_grammars = multi_step, multi_step_grammars
        budget_ms = config.multi_step_budget_ms
        self.step_times = StepTimes(None if budget_ms is None else budget_ms / 1000)
        # Beside in_flight: for each decode-only batch, (scheduled at, steps, batch size), timed when its output
        # comes back; None for other batches.
        self._decode_calls: deque[tuple[float, int, int] | None] = deque()
        if decode_ahead:
            self.num_lookahead_slots = max(self.num_lookahead_slots, 1)
        self.connector: KVConnector | None = None  # disaggregated prefill's (set by the engine core)

    def add_request(self, request: Request) -> None:
        """Queued, or, while its KV arrives from the prefill engine (connector.pull), held by the connector."""
        self.requests[request.request_id] = request
        if self.connector is None or not self.connector.pull(request):
            heapq.heappush(self.waiting, (request.sort_key, request))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        for request in self.connector.arrived() if self.connector is not None else ():
            heapq.heappush(self.waiting, (request.sort_key, request))
        budget, self.encoder_budget = self.max_num_batched_tokens, self.max_encoder_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        steps = self._planned_steps()
        preempted = self._schedule_running(num_scheduled, cached_reqs, spec_tokens, budget, steps)
        budget -= sum(num_scheduled.values())
        if not preempted:
            self._schedule_waiting(num_scheduled, new_reqs, cached_reqs, budget)
        self._record_peak()
        if not num_scheduled:  # nothing runs: finished ids wait for the next batch that does
            return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                                   total_num_scheduled_tokens=0, finished_req_ids=[])
        finished, self.finished_req_ids = self.finished_req_ids, []
        decode_only = not preempted and len(num_scheduled) == len(self.running) and \
            all(n == 1 + len(spec_tokens.get(req_id, ())) for req_id, n in num_scheduled.items())
        if not decode_only:
            steps = 1  # not the batch planned for
        self.in_flight.append({req_id: (self.requests[req_id], self.requests[req_id].num_preemptions)
                               for req_id in num_scheduled})
        self._decode_calls.append((time.perf_counter(), steps, len(num_scheduled))
                                  if decode_only and self.multi_step > 1 else None)
        stores, loads = self.kv.take_copies()  # every block a later step of the call writes was allocated above
        return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                               num_scheduled_tokens=num_scheduled,
                               total_num_scheduled_tokens=sum(num_scheduled.values()), finished_req_ids=finished,
                               scheduled_spec_decode_tokens=spec_tokens,
                               decode_ahead=self.decode_ahead and self._same_decodes_next(num_scheduled, spec_tokens),
                               num_steps=steps, kv_stores=stores, kv_loads=loads)

    def _schedule_running(self, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData],
                          spec_tokens: dict[str, list[int]], budget: int, steps: int) -> bool:
        """Running requests first, in order; preempt from the back when blocks run out. True if any preempted.
        steps: the decode steps of the planned call (multi-step), whose later steps' tokens each request holds
        slots for (_slots_ahead)."""
        preempted_any = False
        slots_ahead = self._slots_ahead(steps)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            drafts = self._drafts_to_verify(request)
            num_new = self._within_encoder_budget(
                request, request.num_computed_tokens,
                min(request.num_tokens + len(drafts) - request.num_computed_tokens, budget))
            if num_new <= 0:  # waiting for the token its last step samples, or for the encoder's next step
                index += 1
                continue
            num_slots = self._with_lookahead(request.num_computed_tokens, num_new, slots_ahead)
            new_blocks = self.kv.allocate_slots(request, num_slots)
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_slots)
            if new_blocks is None:
                continue  # `request` itself was preempted; the next one now sits at `index`
            cached_reqs.append(self._cached_data(request, new_blocks, resumed=False))
            num_real = request.num_tokens - request.num_computed_tokens  # (before _commit counts them computed)
            request.scheduled_spec_token_ids = drafts[:max(0, num_new - num_real)]
            request.spec_token_ids = []
            if request.scheduled_spec_token_ids:
                spec_tokens[request.request_id] = request.scheduled_spec_token_ids
            self._commit(request, num_new, num_scheduled)
            budget -= num_new
            index += 1
        return preempted_any

    def _same_decodes_next(self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]) -> bool:
        """Whether this decode-only step's requests, less any that finish, make the next step: not all of them end
        by length with this token, and no request waits that could join (none, or the running ones fill
        max_num_seqs and none ends by length)."""
        if spec_tokens or any(count != 1 for count in num_scheduled.values()):
            return False
        ends = [tokens_left(r.max_tokens, len(r.output_token_ids), self.max_model_len, r.num_tokens) <= 1
                for r in (self.requests[req_id] for req_id in num_scheduled)]
        if all(ends):
            return False
        return not self.waiting or (len(self.running) >= self.max_num_seqs and not any(ends))

    def _planned_steps(self) -> int:
        """Greedy decode steps for this step's one call (core/multi_step.py), planned before any slot is allocated,
        so that only the decodes of such a call hold slots ahead: several only when every running request decodes
        one token and nothing waiting could join (a new request would otherwise wait out the extra steps)."""
        if self.multi_step <= 1 or not self.running or (self.waiting and len(self.running) < self.max_num_seqs):
            return 1
        if any(r.num_tokens - r.num_computed_tokens != 1 for r in self.running):
            return 1
        return multi_step.num_steps(self.running, self.step_times.limit(len(self.running), self.multi_step),
                                    self.max_model_len, self.multi_step_grammars)

    def _slots_ahead(self, steps: int) -> int:
        """The positions a multi-step call of `steps` steps may write after its first step's tokens: with drafts
        proposed after each step (at most disable_by_batch_size requests), each later step verifies up to k drafts,
        and a draft model writes k - 1 positions past the last, where blocks are to spare (twice every running
        request's share free); else one token per later step (the worker keeps to the slots it got)."""
        config = self.speculative_config
        if steps <= 1 or config is None or (config.disable_by_batch_size is not None
                                            and len(self.running) > config.disable_by_batch_size):
            return steps - 1
        ahead = (steps - 1) * (1 + config.num_speculative_tokens) + self.num_lookahead_slots
        if 2 * len(self.running) * -(-ahead // self.kv.block_size) > self.kv.num_free_blocks:
            return steps - 1
        return ahead

    def _with_lookahead(self, num_computed: int, num_new: int, extra_steps: int = 0) -> int:
        """Slots for a step's tokens and the positions a draft model or a multi-step call's extra steps write after
        them (not past max_model_len)."""
        ahead = max(self.num_lookahead_slots, extra_steps)
        return max(num_new, min(num_new + ahead, self.max_model_len - num_computed))

    def _drafts_to_verify(self, request: Request) -> list[int]:
        """Its proposed drafts that could still become output: one fewer than the tokens it may still take (the
        step adds a token of its own after the accepted ones)."""
        if not request.spec_token_ids:
            return []
        room = tokens_left(request.max_tokens, len(request.output_token_ids), self.max_model_len, request.num_tokens)
        return request.spec_token_ids[:max(0, room - 1)]

    def _schedule_waiting(self, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                          cached_reqs: list[CachedRequestData], budget: int) -> None:
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        skipped: list[tuple[tuple[int, int], Request]] = []  # their adapter would exceed max_loras this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][1]
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(heapq.heappop(self.waiting))
                continue
            if self.whole_prompts:
                if request.num_tokens > budget:
                    break
                num_cached, num_new = 0, request.num_tokens
            else:
                if request.kv_transfer_params is not None and self.connector is not None:
                    self.connector.receive(request)
                computed_blocks = self.kv.computed_blocks(request)
                num_cached = len(computed_blocks) * self.kv.block_size
                num_new = self._within_encoder_budget(request, num_cached, min(request.num_tokens - num_cached, budget))
                if num_new == 0:
                    break
                if self.kv.allocate_slots(request, self._with_lookahead(num_cached, num_new), computed_blocks) is None:
                    break
            heapq.heappop(self.waiting)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            self.kv.record_lookup(request, num_cached)
            request.num_computed_tokens = num_cached
            resumed = request.status == RequestStatus.PREEMPTED
            if resumed:
                request.set_status(RequestStatus.WAITING)
                cached_reqs.append(self._cached_data(request, self.kv.block_ids(request), resumed=True))
            else:
                request.num_cached_tokens = num_cached
                new_reqs.append(NewRequestData(
                    req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params, eos_token_id=request.eos_token_id,
                    block_ids=list(self.kv.block_ids(request)), num_computed_tokens=num_cached,
                    lora_request=request.lora_request, pooling_params=request.pooling_params,
                    token_type_ids=request.token_type_ids, prompt_embeds=request.prompt_embeds,
                    mm_inputs=request.mm_inputs))
            request.set_status(RequestStatus.RUNNING)
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            self._commit(request, num_new, num_scheduled)
            budget -= num_new
        for entry in skipped:
            heapq.heappush(self.waiting, entry)

    def _cached_data(self, request: Request, new_blocks: list[int], resumed: bool) -> CachedRequestData:
        data = CachedRequestData(req_id=request.request_id, new_token_ids=request.unsent_token_ids,
                                 new_block_ids=list(new_blocks), num_computed_tokens=request.num_computed_tokens,
                                 resumed_from_preemption=resumed)
        request.unsent_token_ids = []
        return data

    def _within_encoder_budget(self, request: Request, start: int, num_new: int) -> int:
        """The share of a chunk of `num_new` tokens from `start` whose images' encoding fits the step's encoder
        budget, which it spends (core/encoder_budget.py)."""
        num_new, spent = chunk_within_encoder_budget(request, start, num_new, self.encoder_budget,
                                                     self.encoder_budget == self.max_encoder_tokens)
        self.encoder_budget -= spent
        return num_new

    @staticmethod
    def _commit(request: Request, num_new: int, num_scheduled: dict[str, int]) -> None:
        # Counted as computed when scheduled, so a request is never scheduled twice for the same tokens.
        request.num_computed_tokens += num_new
        num_scheduled[request.request_id] = num_new
        count_encoded(request)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its blocks, start over from token 0 when rescheduled."""
        self.running.remove(request)
        self.kv.free(request)
        request.set_status(RequestStatus.PREEMPTED)
        request.num_computed_tokens = request.num_encoded_images = 0
        request.pending_prompt_logprobs = None  # recomputed with the prompt (sent ones are not: see the runner)
        request.spec_token_ids, request.scheduled_spec_token_ids = [], []
        request.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (request.sort_key, request))
