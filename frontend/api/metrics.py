"""Prometheus metrics of a gateway: request latencies and token counts here, scheduler state from the engine; each
under its pagedserve: name and vLLM's (metric_names.py), with vLLM's labels and bucket boundaries.

With several gateway processes (`--api-server-count`) the launcher sets PROMETHEUS_MULTIPROC_DIR, and every
gateway's /metrics then sums the request metrics of all of them (prometheus_client's multiprocess mode).
"""
from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from frontend.api.metric_names import PREFIX, with_vllm_names
from ipc import SchedulerStats, SpecDecodingStats

# vLLM's bucket boundaries, so that its dashboards' histogram_quantile panels read the same buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
DEFAULT_MAX_MODEL_LEN = 1 << 17  # the token-count histograms' top bucket when the gateway does not say its limit
UNKNOWN_REASON = "unknown"  # a request ended without its caller saying why


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: the token-count histograms' buckets, as vLLM's."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        token_buckets = one_two_five_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        metrics = (
            Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests", **labels),
            Counter(f"{PREFIX}generation_tokens", "Generated tokens", **labels),
            Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, **labels),
            Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between tokens of a stream",
                      buckets=TOKEN_LATENCY_BUCKETS, **labels),
            Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival to end",
                      buckets=REQUEST_LATENCY_BUCKETS, **labels),
            Histogram(f"{PREFIX}request_prompt_tokens", "Prompt tokens of a finished request", buckets=token_buckets,
                      **labels),
            Histogram(f"{PREFIX}request_generation_tokens", "Tokens generated for a finished request",
                      buckets=token_buckets, **labels))
        # Bound to the label once: these are touched for every token.
        (self.prompt_tokens, self.generation_tokens, self.ttft, itl, self.e2e, self.request_prompt_tokens,
         self.request_generation_tokens) = (metric.labels(model_name) for metric in metrics)
        self.success = Counter(f"{PREFIX}request_success", "Choices that ended normally, by finish reason",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.itl = HistogramTally(itl)
        self.model_name = model_name

    def observe_token_times(self, ttft: float | None, itl: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def observe_request(self, num_prompt_tokens: int, num_generated_tokens: int, e2e: float,
                        finish_reasons: Sequence[str | None]) -> None:
        """A request that ended normally; `finish_reasons` has one per choice (None: UNKNOWN_REASON)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated_tokens)
        for reason in finish_reasons:
            self.success.labels(self.model_name, reason or UNKNOWN_REASON).inc()
        self.e2e.observe(e2e)
        self.itl.flush()

    def render(self, stats: SchedulerStats) -> bytes:
        """The Prometheus text exposition: this process's (or all gateways') request metrics + engine state, each
        under both names."""
        self.itl.flush()
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            requests = CollectorRegistry()
            MultiProcessCollector(requests)
        else:
            requests = self.registry
        families = [*requests.collect(), *_EngineCollector(stats, self.model_name).collect()]
        return generate_latest(_Families(with_vllm_names(families)))


class _Families:
    """Families already collected, in the shape generate_latest reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


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
    """The engine's state. A data-parallel group's (GroupStats) is one series per live engine, labelled engine="K"
    as vLLM's, and engine_up says which engines are alive (a gone engine's other series are absent)."""

    def __init__(self, stats: SchedulerStats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> list[Metric]:
        engines: list[SchedulerStats | None] | None = getattr(self.stats, "engines", None)
        if engines is None:
            return list(_engine_families(self.stats, [self.model_name]))
        labelnames = ["model_name", "engine"]
        up = GaugeMetricFamily(f"{PREFIX}engine_up", "1 while this engine core of the data-parallel group serves, 0 "
                               "once it is gone", labels=labelnames)
        families: dict[str, Metric] = {}
        for engine, stats in enumerate(engines):
            labels = [self.model_name, str(engine)]
            up.add_metric(labels, float(stats is not None))
            for family in _engine_families(stats, labels, labelnames) if stats is not None else ():
                merged = families.setdefault(family.name, family)  # one family per name, a sample per engine
                if merged is not family:
                    merged.samples += family.samples
        return [*families.values(), up]


def _engine_families(stats: SchedulerStats, labels: list[str], labelnames: Sequence[str] = ("model_name",)):
    """One engine's state, a family per metric."""
    yield from _families(GaugeMetricFamily, labels, (
        ("num_requests_running", "Requests running in the engine", stats.num_running),
        ("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
        ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (in CPU memory without an accelerator)",
         stats.kv_cache_usage)), labelnames)
    yield from _families(CounterMetricFamily, labels, (
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        ("prefix_cache_host_hits", "Of those, tokens found in the host-memory tier and loaded from it",
         stats.prefix_cache_host_hits),
        ("num_preemptions", "Requests preempted", stats.num_preemptions),
        ("num_aborted_requests", "Requests aborted (client gone, stop string, cancel)",
         stats.num_aborted_requests)), labelnames)
    if stats.spec_decoding is not None:
        yield from _spec_decoding_metrics(stats.spec_decoding, labels, labelnames)


def _families(family: type, labels: list[str], rows: tuple[tuple[str, str, float], ...],
              labelnames: Sequence[str] = ("model_name",)):
    """One metric family per (name, doc, value), labelled with the model's name (and the engine's, with several)."""
    for name, doc, value in rows:
        metric = family(f"{PREFIX}{name}", doc, labels=labelnames)
        metric.add_metric(labels, value)
        yield metric


def _spec_decoding_metrics(spec: SpecDecodingStats, labels: list[str], labelnames: Sequence[str] = ("model_name",)):
    """Counters from which every rate follows: acceptance rate = accepted / draft tokens; tokens per verification
    step = 1 + accepted / drafts; position i's acceptance = accepted_per_pos / drafted_per_pos at that position."""
    yield from _families(CounterMetricFamily, labels, (
        ("spec_decode_num_drafts", "Draft runs verified (one per request per step that speculated)", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)), labelnames)
    for name, doc, values in (("num_drafted_tokens_per_pos", "Draft runs that had a token at this position",
                               spec.drafted_per_position),
                              ("num_accepted_tokens_per_pos", "Draft runs accepted up to and including this position",
                               spec.accepted_per_position)):
        counter = CounterMetricFamily(f"{PREFIX}spec_decode_{name}", doc, labels=[*labelnames, "position"])
        for position, value in enumerate(values):
            counter.add_metric([*labels, str(position)], value)
        yield counter
