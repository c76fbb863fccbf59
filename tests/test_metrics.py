"""The gateway's metrics: the bulk-added inter-token histogram against prometheus_client's own Histogram.observe,
and every family under vLLM's name, type, labels and buckets."""
from __future__ import annotations

import random

import pytest

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.api.metrics import HistogramTally, ServerMetrics
from ipc import SchedulerStats, SpecDecodingStats

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
    assert sample("pagedserve:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.05"}) == 2
    assert abs(sample("pagedserve:inter_token_latency_seconds_sum", {"model_name": "m"}) - 3.05) < 1e-9


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


VLLM_TYPES = {  # the families vLLM's dashboards graph, by their name without a counter's _total
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:gpu_prefix_cache_queries": "counter", "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter", "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter"}
VLLM_TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_E2E_BOUNDS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def _exposed(metrics: ServerMetrics, stats: SchedulerStats) -> dict:
    return {family.name: family for family in text_string_to_metric_families(metrics.render(stats).decode())}


def _stats(**changes) -> SchedulerStats:
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    fields = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "num_free_blocks": 30,
              "num_preemptions": 3, "prefix_cache_queries": 64, "prefix_cache_hits": 16, "spec_decoding": spec}
    return SchedulerStats(**{**fields, **changes})


def test_every_family_is_served_under_vllms_name_type_and_label():
    metrics = ServerMetrics("m", max_model_len=512)
    metrics.observe_token_times(0.05, None)
    metrics.observe_token_times(None, 0.02)
    metrics.observe_request(12, 7, 0.4, ["stop", "length", "stop"])
    families = _exposed(metrics, _stats())
    for name, kind in VLLM_TYPES.items():
        assert families[name].type == kind, name
        assert families[name].samples, name
        assert all(sample.labels["model_name"] == "m" for sample in families[name].samples), name
        ours = families[name.replace("vllm:", "pagedserve:").replace("gpu_cache", "kv_cache").replace(
            "gpu_prefix", "prefix").replace("time_per_output_token", "inter_token_latency")]
        assert [(s.labels, s.value) for s in ours.samples] == [(s.labels, s.value) for s in families[name].samples]
    bounds = sorted({float(s.labels["le"]) for s in families["vllm:time_to_first_token_seconds"].samples
                     if s.name.endswith("_bucket")})
    assert bounds == [*VLLM_TTFT_BOUNDS, float("inf")]
    bounds = sorted({float(s.labels["le"]) for s in families["vllm:e2e_request_latency_seconds"].samples
                     if s.name.endswith("_bucket")})
    assert bounds == [*VLLM_E2E_BOUNDS, float("inf")]
    bounds = sorted({float(s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples
                     if s.name.endswith("_bucket")})
    assert bounds == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")]  # up to max_model_len


def test_vllm_named_values_follow_requests_and_engine_state():
    metrics = ServerMetrics("m")
    sample = metrics.registry.get_sample_value
    metrics.observe_token_times(0.05, None)
    for _ in range(3):
        metrics.observe_token_times(None, 0.02)
    metrics.observe_request(12, 4, 0.4, ["stop"])
    metrics.observe_request(30, 9, 2.0, ["length", "stop"])
    metrics.observe_request(5, 1, 0.1, [None])  # a choice that ended without a reason: counted as unknown
    families = _exposed(metrics, _stats(num_running=0, kv_cache_usage=0.5))

    def value(family: str, sample_name: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples
                    if s.name == sample_name and s.labels == {"model_name": "m", **labels})

    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 2
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="unknown") == 1
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 47
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 14
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_count") == 3
    assert value("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 3
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 2
    assert value("vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == 0.5
    assert value("vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    assert value("vllm:num_preemptions", "vllm:num_preemptions_total") == 3
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 position="1") == 1
    assert sample("pagedserve:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 2

