"""A data-parallel group's scheduler stats: the group's sum, which callers of get_stats read as one engine's, with
each engine's own beside it (for the metrics' engine label)."""
from __future__ import annotations

from ipc import SchedulerStats, SpecDecodingStats


class GroupStats(SchedulerStats, kw_only=True):
    engines: list[SchedulerStats | None] = []  # by engine index; None for an engine that is gone


def group_stats(per_engine: list[SchedulerStats | None]) -> GroupStats:
    """The live engines' stats combined (at least one must be live), and every engine's."""
    combined = combined_stats([stats for stats in per_engine if stats is not None])
    return GroupStats(**{field: getattr(combined, field) for field in SchedulerStats.__struct_fields__},
                      engines=per_engine)


def combined_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The group's stats: counts summed, usage averaged over the engines (each has as many blocks), peaks the
    highest."""
    def total(field: str) -> int:
        return sum(getattr(s, field) for s in stats)

    specs = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    spec = None
    if specs:
        width = max(len(s.drafted_per_position) for s in specs)
        spec = SpecDecodingStats(
            num_drafts=sum(s.num_drafts for s in specs), num_draft_tokens=sum(s.num_draft_tokens for s in specs),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in specs),
            drafted_per_position=[sum(s.drafted_per_position[i] for s in specs if i < len(s.drafted_per_position))
                                  for i in range(width)],
            accepted_per_position=[sum(s.accepted_per_position[i] for s in specs
                                       if i < len(s.accepted_per_position)) for i in range(width)])
    counts = ("num_running", "num_waiting", "num_free_blocks", "num_preemptions", "num_aborted_requests",
              "peak_num_running", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_host_hits",
              "kv_transfer_blocks_sent", "kv_transfer_blocks_received", "kv_transfer_recomputes")
    return SchedulerStats(**{field: total(field) for field in counts},
                          kv_cache_usage=total("kv_cache_usage") / len(stats),
                          peak_kv_cache_usage=max(s.peak_kv_cache_usage for s in stats),
                          kv_utilization_at_peak=total("kv_utilization_at_peak") / len(stats), spec_decoding=spec)
