"""fp8 KV cache (issue 57) against the model dtype's, in one run: accuracy, decode attention, throughput.

1. Accuracy: the shipped demo model (bf16) over its held-out text (benchmarks/demo_perplexity.py's windows), scored
   through prompt_logprobs with kv_cache_dtype auto and fp8 (e4m3; --formats adds fp8_e5m2): top-1 agreement with
   auto's over every scored position, and perplexity. Targets: agreement >= 99%, perplexity within 1%. Also the
   agreement on the positions auto's top-1 decides (leads its runner-up by >= DECIDED_MARGIN nats; the rest are near
   ties that any change of rounding flips, the bf16 model against the float32 one included) and auto's exact ties.
2. Decode attention: benchmarks/cpu_decode_attention.py's comparison (a whole-engine-sized cache, flushed before
   each call) of bf16 against fp8 caches: median time per call, K/V bytes read per second, fp8's time over bf16's.
3. Throughput: the issue's 96-request workload (benchmarks/throughput.py: inputs 16-400, outputs 8-200 tokens,
   greedy, ignore_eos, the model maker's benchmark llama, bf16) with kv_cache_dtype auto and fp8 alternating for
   --rounds rounds; output tokens/s of each and fp8 / auto (target >= 1.15x on a CPU with native bf16).
   --kv-cache-memory gives both the same KV budget (bytes or "24MiB"): below the workload's peak, where bf16's pool
   cannot hold every running request and fp8's holds twice the tokens (what fp8 KV is for on a server whose memory
   is full); each kind's peak KV use and preemptions are printed. --long-context runs a workload whose decode
   attention is most of a step instead: LONG_REQUESTS requests of LONG_INPUTS prompt tokens and LONG_OUTPUTS
   output tokens, all running at once (every step reads each request's whole context of K/V).
    python benchmarks/kv_cache_fp8.py [--windows 64] [--rounds 2] [--skip-accuracy] [--skip-throughput]
                                      [--kv-cache-memory SIZE] [--long-context]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_decode_attention as attention_bench  # noqa: E402
from demo_perplexity import held_out_tokens  # noqa: E402
from throughput import make_requests, run_engine  # noqa: E402

from frontend import LLM, SamplingParams  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402
from launch.shipped import WEIGHTS_DIR  # noqa: E402

AGREEMENT_TARGET, PERPLEXITY_TARGET, SPEEDUP_TARGET = 0.99, 0.01, 1.15
DECIDED_MARGIN = 0.2  # nats between auto's top two logprobs
# --long-context: the benchmark model holds 2048 positions.
LONG_REQUESTS, LONG_INPUTS, LONG_OUTPUTS = 32, (1408, 1664), (256, 384)


def scored(model: Path, windows: torch.Tensor, kv_cache_dtype: str) -> tuple[float, list[int], list[float]]:
    """(summed NLL of every window's tokens after the first, the top-1 token at each of those positions, its lead
    over the runner-up in logprob)."""
    llm = LLM(str(model), dtype="bfloat16", in_process=True, kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
        outputs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows], params, use_tqdm=False)
    finally:
        llm.shutdown()
    nll, top1, margins = 0.0, [], []
    for output, window in zip(outputs, windows):
        for entry, token in zip(output.prompt_logprobs[1:], window[1:].tolist()):
            nll -= entry[token].logprob
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            top1.append(ranked[0][0])
            margins.append(ranked[0][1].logprob - ranked[1][1].logprob)
    return nll, top1, margins


def accuracy(windows_wanted: int, formats: list[str]) -> None:
    model = WEIGHTS_DIR / "demo"
    windows = held_out_tokens(model, windows_wanted)
    count = windows.shape[0] * (windows.shape[1] - 1)
    base_nll, base_top1, margins = scored(model, windows, "auto")
    decided = [m >= DECIDED_MARGIN for m in margins]
    print(f"accuracy: demo model, {count} held-out tokens in {windows.shape[0]} windows; bf16 KV perplexity "
          f"{math.exp(base_nll / count):.3f}; its top two tie exactly at {sum(m == 0 for m in margins) / count:.2%} "
          f"of positions, its top-1 leads by >= {DECIDED_MARGIN} at {sum(decided) / count:.2%}")
    for kv_cache_dtype in formats:
        nll, top1, _ = scored(model, windows, kv_cache_dtype)
        same = [a == b for a, b in zip(top1, base_top1)]
        on_decided = sum(s for s, d in zip(same, decided) if d) / max(1, sum(decided))
        change = math.exp(nll / count) / math.exp(base_nll / count) - 1
        print(f"  {kv_cache_dtype}: top-1 agreement {sum(same) / count:.2%} (target >= {AGREEMENT_TARGET:.0%}; "
              f"{on_decided:.2%} where bf16 KV's top-1 leads by >= {DECIDED_MARGIN}), perplexity "
              f"{math.exp(nll / count):.3f} ({change:+.2%}, target within {PERPLEXITY_TARGET:.0%})")


def throughput(rounds: int, num_requests: int, kv_cache_memory: str | None, long_context: bool) -> None:
    model = str(ensure_benchmark_model())
    from transformers import AutoConfig
    inputs, outputs = (LONG_INPUTS, LONG_OUTPUTS) if long_context else ((16, 400), (8, 200))
    num_requests = LONG_REQUESTS if long_context else num_requests
    requests = make_requests(num_requests, AutoConfig.from_pretrained(model).vocab_size, 0, inputs, outputs)
    args = argparse.Namespace(dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=2048)
    runs: dict[str, list[dict]] = {"auto": [], "fp8": []}
    for _ in range(rounds):
        for kv_cache_dtype in runs:
            budget = {} if kv_cache_memory is None else {"kv_cache_memory": kv_cache_memory}
            runs[kv_cache_dtype].append(run_engine(model, requests, args, kv_cache_dtype=kv_cache_dtype, **budget))
    rates = {kind: sum(r["output_tokens"] for r in each) / sum(r["seconds"] for r in each)
             for kind, each in runs.items()}
    print(f"throughput: {num_requests} requests (inputs {inputs[0]}-{inputs[1]}, outputs {outputs[0]}-{outputs[1]}), "
          f"{model}, {rounds} alternating rounds"
          f", KV budget {kv_cache_memory or 'the default'}")
    for kind, each in runs.items():
        each_rate = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in each)
        peak, preempted = max(r["peak_kv_cache_usage"] for r in each), sum(r["num_preemptions"] for r in each)
        print(f"  {kind}: {rates[kind]:.1f} output tok/s (runs: {each_rate}); peak KV use {peak:.0%}, "
              f"preemptions {preempted}")
    print(f"  fp8 / auto: {rates['fp8'] / rates['auto']:.2f}x (target >= {SPEEDUP_TARGET}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows to score (at most)")
    parser.add_argument("--formats", nargs="+", default=["fp8"], choices=["fp8", "fp8_e5m2"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=96, help="the issue's workload: 96")
    parser.add_argument("--kv-cache-memory", help="one KV budget for both kinds (bytes or a size like 24MiB)")
    parser.add_argument("--long-context", action="store_true", help="the long-context workload (see above)")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    if not args.skip_accuracy:
        accuracy(args.windows, args.formats)
    if not args.skip_attention:
        attention_bench.compare_formats(args.formats)
    if not args.skip_throughput:
        throughput(args.rounds, args.num_requests, args.kv_cache_memory, args.long_context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
