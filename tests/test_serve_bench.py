"""The dataset serving benchmark (benchmarks/serve.py): against the demo server with the shipped ShareGPT file at two
rates, its plot, the vLLM-named metrics those requests move; and its reader, stream timing and percentiles alone."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the repo: benchmarks/kernels.py

import serve  # noqa: E402
from conftest import API_KEY, AUTH, metric  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402
from serve_client import RequestResult, read_stream  # noqa: E402
from serve_dataset import RequestSpec, load_tokenizer, sharegpt_requests  # noqa: E402
from serve_report import compute_metrics  # noqa: E402

DEMO = str(shipped_model("demo"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def test_the_sharegpt_benchmark_runs_at_two_rates_plots_and_moves_the_vllm_metrics(demo_server, tmp_path):
    names = ("vllm:generation_tokens_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
             "vllm:request_prompt_tokens_count")
    before, successes_before = {name: metric(demo_server, name) for name in names}, successes(demo_server)
    saved, plot = tmp_path / "result.json", tmp_path / "latency.png"
    code = serve.main(["--base-url", demo_server, "--api-key", API_KEY, "--num-prompts", "6", "--request-rate",
                       "20,inf", "--seed", "1", "--tokenizer", DEMO, "--max-total-len", "512", "--ignore-eos",
                       "--save-result", str(saved), "--plot", str(plot), "--no-progress"])
    assert code == 0
    runs = json.loads(saved.read_text())["runs"]
    assert [run["config"]["request_rate"] for run in runs] == [20.0, "inf"]
    specs = sharegpt_requests(serve.DEFAULT_DATASET, 6, 1, load_tokenizer(DEMO), 512)
    for run in runs:
        figures = run["metrics"]
        assert (figures["completed"], figures["failed"]) == (6, 0)
        assert all(request["success"] for request in run["requests"])
        assert figures["total_output_tokens"] == sum(spec.output_len for spec in specs)  # ignore_eos: all of them
        assert figures["output_tokens_from"] == {"usage": 6}
        for name in LATENCIES:
            values = [figures[name][key] for key in ("p50_ms", "p90_ms", "p99_ms")]
            assert None not in values and values == sorted(values), name
        assert figures["ttft"]["p99_ms"] <= figures["e2e"]["p99_ms"]
    assert plot.read_bytes()[:8] == PNG_MAGIC
    sent = 1 + 2 * 6  # the warm-up request, then each run's
    generated = serve.WARM_UP_OUTPUT_LEN + sum(run["metrics"]["total_output_tokens"] for run in runs)
    moved = {name: metric(demo_server, name) - before[name] for name in names}
    assert moved == {"vllm:generation_tokens_total": generated, "vllm:request_success_total": sent,
                     "vllm:time_to_first_token_seconds_count": sent, "vllm:request_prompt_tokens_count": sent}
    assert metric(demo_server, "vllm:num_requests_running") == 0
    ended = [series for series, count in successes(demo_server).items() if count != successes_before.get(series, 0)]
    assert ended and all('finished_reason="length"' in series for series in ended)  # ignore_eos: each ran out


def successes(base_url: str) -> dict[str, float]:
    """The server's vllm:request_success_total count by its labels (the finish reason's among them)."""
    lines = httpx.get(f"{base_url}/metrics", headers=AUTH).text.splitlines()
    return {series: float(count) for series, count in (line.rsplit(" ", 1) for line in lines
                                                       if line.startswith("vllm:request_success_total{"))}


def test_random_prompts_on_the_chat_endpoint_plot_each_request(demo_server, tmp_path):
    saved, plot = tmp_path / "result.json", tmp_path / "requests.png"
    code = serve.main(["--base-url", demo_server, "--api-key", API_KEY, "--endpoint", "chat", "--dataset-name",
                       "random", "--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "8",
                       "--tokenizer", DEMO, "--ignore-eos", "--save-result", str(saved), "--plot", str(plot),
                       "--no-progress"])
    assert code == 0
    (run,) = json.loads(saved.read_text())["runs"]
    assert run["config"]["endpoint"] == "chat"
    assert [request["output_tokens"] for request in run["requests"]] == [8, 8, 8]
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_bad_options_are_refused_by_the_parser():
    for argv in (["--request-rate", "0"], ["--request-rate", "fast"], ["--endpoint", "chat", "--dataset-name",
                                                                       "random"]):
        with pytest.raises(SystemExit) as refused:
            serve.parse_args(argv)
        assert refused.value.code == 2, argv


class Words:
    """A tokenizer of whitespace-separated words."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)


def test_the_sharegpt_reader_takes_each_first_pair_and_skips_the_unusable(tmp_path):
    def turns(*pairs: tuple[str, str]) -> dict:
        return {"conversations": [{"from": speaker, "value": text} for speaker, text in pairs]}

    words = " ".join
    conversations = [
        turns(("system", "be brief"), ("human", words(["q"] * 5)), ("gpt", words(["a"] * 6)),
              ("human", "later question"), ("gpt", words(["b"] * 50))),
        turns(("gpt", "an answer first"), ("human", words(["r"] * 4)), ("gpt", words(["c"] * 4))),
        turns(("human", "too short"), ("gpt", words(["d"] * 10))),  # a 2-token prompt
        turns(("human", words(["s"] * 10)), ("gpt", words(["e"] * 60))),  # 70 tokens: over the limit
        turns(("human", words(["t"] * 10))),  # no answer
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    specs = sharegpt_requests(path, 5, seed=3, tokenizer=Words(), max_total_len=64)
    usable = {(words(["q"] * 5), 6), (words(["r"] * 4), 4)}
    assert {(spec.prompt, spec.output_len) for spec in specs} == usable
    assert len(specs) == 5 and specs[2] == specs[0]  # fewer usable than asked for: taken again in turn
    assert all(spec.prompt_len == len(spec.prompt.split()) for spec in specs)
    assert sharegpt_requests(path, 5, seed=3, tokenizer=Words(), max_total_len=64) == specs
    assert {spec.output_len for spec in sharegpt_requests(path, 2, 0, Words(), 64, output_len=9)} == {9}
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(path, 1, 0)


def test_percentiles_and_tpot_from_made_up_timings():
    results = [RequestResult(success=True, ttft=0.1 * i, e2e=0.1 * i + 1.0, itl=[0.01 * i, 0.02 * i],
                             prompt_tokens=10, output_tokens=11) for i in range(1, 11)]
    results += [RequestResult(success=True, ttft=5.0, e2e=5.0, output_tokens=1),  # one token: no TPOT
                RequestResult(error="HTTP 429: busy", e2e=0.01)]
    figures = compute_metrics(results, duration=2.0)
    assert (figures["completed"], figures["failed"], figures["errors"]) == (11, 1, {"HTTP 429: busy": 1})
    assert figures["total_output_tokens"] == 111 and figures["output_token_throughput"] == 55.5
    ttfts_ms = [100.0 * i for i in range(1, 11)] + [5000.0]  # sorted: the 50th percentile is the 6th
    assert figures["ttft"]["p50_ms"] == pytest.approx(600.0)
    assert figures["ttft"]["mean_ms"] == pytest.approx(sum(ttfts_ms) / 11)
    assert figures["ttft"]["p90_ms"] == pytest.approx(1000.0)  # rank 9 of 0..10
    assert figures["ttft"]["p99_ms"] == pytest.approx(1000.0 + 0.9 * 4000.0)  # between ranks 9 and 10
    assert figures["tpot"]["p50_ms"] == pytest.approx(100.0)  # every one (e2e - ttft) / 10 = 1.0 s / 10
    assert figures["itl"]["p50_ms"] == pytest.approx(75.0)  # 20 gaps: between 70 (7th) and 80 (8th) ms
    assert figures["e2e"]["p90_ms"] == pytest.approx(2000.0)


def test_stream_timing_without_usage_counts_content_chunks():
    events = [(10.0, b'{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'),
              (10.5, b'{"choices": [{"index": 0, "delta": {"content": "def"}}]}'),
              (10.7, b'{"choices": [{"index": 0, "delta": {"content": " f"}}]}'),
              (11.0, b'{"choices": [{"index": 0, "delta": {"content": "():"}}]}'),
              (11.2, b"[DONE]")]
    result = RequestResult()
    read_stream(events, result, 9.9, RequestSpec("prompt", 3, prompt_len=7), tokenizer=None)
    assert result.success and result.ttft == pytest.approx(0.6)  # the first chunk with content, not the role's
    assert result.itl == pytest.approx([0.2, 0.3]) and result.e2e == pytest.approx(1.3)
    assert (result.output_tokens, result.output_tokens_from, result.prompt_tokens) == (3, "chunks", 7)
    cut = RequestResult()
    read_stream(events[:2], cut, 9.9, RequestSpec("prompt", 3), tokenizer=None)
    assert not cut.success and "[DONE]" in cut.error
