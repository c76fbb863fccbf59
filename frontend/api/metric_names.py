"""vLLM's names for the gateway's metrics: each family is served under its pagedserve: name and under these, so that
dashboards and alerts built for vLLM read this server unchanged."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import Metric

PREFIX = "pagedserve:"

# Ours (without the prefix) -> vLLM's. Two vLLM names where vLLM renamed a metric and dashboards use either; the KV
# cache is "gpu" in vLLM's older name even where it lives in CPU memory, as here without an accelerator. vLLM's
# time_per_output_token_seconds is, like its inter_token_latency_seconds, observed once per token.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


def with_vllm_names(families: Iterable[Metric]) -> Iterator[Metric]:
    """Each family, followed by a copy under each of its vLLM names (same type, labels and values)."""
    for family in families:
        yield family
        for name in VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()):
            yield renamed(family, name)


def renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    # A sample's name is the family's plus a suffix (_total, _bucket, _sum, _count, _created).
    copy.samples = [sample._replace(name=name + sample.name[len(family.name):]) for sample in family.samples]
    return copy
