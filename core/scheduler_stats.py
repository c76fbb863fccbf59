"""The scheduler's figures: the peak of its KV cache use and its counts, as SchedulerStats."""
from __future__ import annotations

import copy

from ipc import SchedulerStats


class SchedulerCounters:
    """Mixed into core.scheduler.Scheduler, whose state it reads (requests, running, kv, num_preemptions,
    num_aborted_requests, spec_stats, connector) and whose peak figures it keeps (peak_num_running, peak_kv_usage,
    kv_utilization_at_peak)."""

    def _record_peak(self) -> None:
        """At the step with the most blocks in use: tokens held in KV blocks / slots in allocated blocks. And the
        most requests running at once (how many the KV cache fits, when it is what limits them)."""
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        usage = self.kv.usage
        if usage > self.peak_kv_usage:
            slots = self.kv.num_allocated_slots()
            self.peak_kv_usage = usage
            self.kv_utilization_at_peak = sum(r.num_computed_tokens for r in self.running) / slots

    @property
    def num_waiting(self) -> int:
        """Requests queued, or with their KV still arriving (disaggregated prefill)."""
        return len(self.requests) - len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.running), num_waiting=self.num_waiting,
                              kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.num_free_blocks,
                              num_preemptions=self.num_preemptions, num_aborted_requests=self.num_aborted_requests,
                              peak_kv_cache_usage=self.peak_kv_usage,
                              kv_utilization_at_peak=self.kv_utilization_at_peak,
                              peak_num_running=self.peak_num_running,
                              prefix_cache_queries=self.kv.prefix_cache_queries,
                              prefix_cache_hits=self.kv.prefix_cache_hits,
                              prefix_cache_host_hits=self.kv.prefix_cache_host_hits,
                              spec_decoding=copy.deepcopy(self.spec_stats), **self._transfer_counts())

    def _transfer_counts(self) -> dict[str, int]:
        connector = self.connector
        if connector is None:
            return {}
        return {"kv_transfer_blocks_sent": connector.blocks_sent, "kv_transfer_blocks_received":
                connector.blocks_received, "kv_transfer_recomputes": connector.recomputes}

