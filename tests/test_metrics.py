"""The gateway's bulk-added inter-token histogram against prometheus_client's own Histogram.observe."""
from __future__ import annotations

import random

import pytest

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from frontend.api.metrics import ServerMetrics, HistogramTally

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("latency_seconds", "latency", buckets=BUCKETS, registry=registry)


def test_a_tally_exposes_what_observe_would():
    rng = random.Random(0)
    values = [rng.uniform(0, 2) for _ in range(500)] + list(BUCKETS) + [0.0, 50.0]
    reference, tallied = CollectorRegistry(), CollectorRegistry()
    observed, tally = histogram(reference), HistogramTally(histogram(tallied))
    assert tally.bulk
    for i, value in enumerate(values):
        observed.observe(value)
        tally.observe(value)
        if i % 97 == 0:
            tally.flush()
    assert generate_latest(tallied) != generate_latest(reference)  # the tail is not flushed yet
    tally.flush()
    tally.flush()  # nothing new: adds nothing
    expected, got = _samples(reference), _samples(tallied)
    assert got.keys() == expected.keys()
    for key, value in expected.items():  # the sum is added in a different order: equal up to rounding
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_metrics_show_token_latencies_not_yet_flushed():
    metrics = ServerMetrics("m")
    for itl in (0.02, 0.03, 3.0):
        metrics.observe_token_times(None, itl)
    sample = metrics.registry.get_sample_value
    assert sample("pagedserve:inter_token_latency_seconds_count", {"model_name": "m"}) == 0
    metrics.itl.flush()
    assert sample("pagedserve:inter_token_latency_seconds_count", {"model_name": "m"}) == 3
    assert sample("pagedserve:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.04"}) == 2
    assert abs(sample("pagedserve:inter_token_latency_seconds_sum", {"model_name": "m"}) - 3.05) < 1e-9


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}
