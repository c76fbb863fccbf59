"""Prometheus metrics of a gateway: request latencies and token counts here, scheduler state from the engine.

With several gateway processes (`--api-server-count`) the launcher sets PROMETHEUS_MULTIPROC_DIR, and every
gateway's /metrics then sums the request metrics of all of them (prometheus_client's multiprocess mode).
"""
from __future__ import annotations

import os
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from ipc import SchedulerStats, SpecDecodingStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        metrics = (
            Counter("pagedserve:prompt_tokens", "Prompt tokens of finished requests", **labels),
            Counter("pagedserve:generation_tokens", "Generated tokens", **labels),
            Counter("pagedserve:request_success", "Requests that ended normally", **labels),
            Histogram("pagedserve:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                      **labels),
            Histogram("pagedserve:inter_token_latency_seconds", "Time between tokens of a stream",
                      buckets=_LATENCY_BUCKETS, **labels),
            Histogram("pagedserve:e2e_request_latency_seconds", "Request latency, arrival to end",
                      buckets=_LATENCY_BUCKETS, **labels))
        # Bound to the label once: these are touched for every token.
        (self.prompt_tokens, self.generation_tokens, self.requests, self.ttft, itl,
         self.e2e) = (metric.labels(model_name) for metric in metrics)
        self.itl = HistogramTally(itl)
        self.model_name = model_name

    def observe_token_times(self, ttft: float | None, itl: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def observe_request(self, num_prompt_tokens: int, num_generated_tokens: int, e2e: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.requests.inc()
        self.e2e.observe(e2e)
        self.itl.flush()

    def render(self, stats: SchedulerStats) -> bytes:
        """The Prometheus text exposition: this process's (or all gateways') request metrics + engine state."""
        self.itl.flush()
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            requests = CollectorRegistry()
            MultiProcessCollector(requests)
        else:
            requests = self.registry
        engine = CollectorRegistry()
        engine.register(_EngineCollector(stats, self.model_name))
        return generate_latest(requests) + generate_latest(engine)


class HistogramTally:
    """Observations of a histogram counted here and added to it in bulk by flush(). The inter-token latency is observed
    once per streamed token, and Histogram.observe (a lock per value and bucket) was ~5% of the gateway's CPU per
    token; a tally costs a tenth of that. Bulk adding reads prometheus_client's bucket values (`_upper_bounds`,
    `_buckets`, `_sum`, unchanged since its first releases); without them every value goes to observe() at once."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.bulk = all(hasattr(histogram, name) for name in ("_upper_bounds", "_buckets", "_sum"))
        self.bounds = list(histogram._upper_bounds) if self.bulk else []
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        if not self.bulk:
            self.histogram.observe(value)
            return
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value, as observe()
        self.total += value

    def flush(self) -> None:
        """Add what was observed since the last flush to the histogram."""
        if not self.bulk or not any(self.counts):
            return
        self.histogram._sum.inc(self.total)
        for bucket, count in zip(self.histogram._buckets, self.counts):
            if count:
                bucket.inc(count)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0


class _EngineCollector:
    def __init__(self, stats: SchedulerStats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats, labels = self.stats, [self.model_name]
        yield from _families(GaugeMetricFamily, labels, (
            ("num_requests_running", "Requests running in the engine", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use", stats.kv_cache_usage)))
        yield from _families(CounterMetricFamily, labels, (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            ("num_preemptions", "Requests preempted", stats.num_preemptions),
            ("num_aborted_requests", "Requests aborted (client gone, stop string, cancel)",
             stats.num_aborted_requests)))
        if stats.spec_decoding is not None:
            yield from _spec_decoding_metrics(stats.spec_decoding, labels)


def _families(family: type, labels: list[str], rows: tuple[tuple[str, str, float], ...]):
    """One metric family per (name, doc, value), labelled with the model's name."""
    for name, doc, value in rows:
        metric = family(f"pagedserve:{name}", doc, labels=["model_name"])
        metric.add_metric(labels, value)
        yield metric


def _spec_decoding_metrics(spec: SpecDecodingStats, labels: list[str]):
    """Counters from which every rate follows: acceptance rate = accepted / draft tokens; tokens per verification
    step = 1 + accepted / drafts; position i's acceptance = accepted_per_pos / drafted_per_pos at that position."""
    yield from _families(CounterMetricFamily, labels, (
        ("spec_decode_num_drafts", "Draft runs verified (one per request per step that speculated)", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)))
    for name, doc, values in (("num_drafted_tokens_per_pos", "Draft runs that had a token at this position",
                               spec.drafted_per_position),
                              ("num_accepted_tokens_per_pos", "Draft runs accepted up to and including this position",
                               spec.accepted_per_position)):
        counter = CounterMetricFamily(f"pagedserve:spec_decode_{name}", doc, labels=["model_name", "position"])
        for position, value in enumerate(values):
            counter.add_metric([*labels, str(position)], value)
        yield counter
