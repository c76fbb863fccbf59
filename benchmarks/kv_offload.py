"""The prefix cache's host tier (--kv-offload-bytes): prefix hit rate and throughput with the tier against without.

The workload (issue 57's): shared prefixes 4x the device cache. --prefixes prefixes of 256 tokens (16 blocks of 16),
each asked --rounds times with a 16-token suffix of its own, round after round (so a prefix comes back after all the
others have passed through the cache), 16 output tokens each, greedy with ignore_eos, on the shipped demo model. The
device cache gets --blocks blocks (default 64: a quarter of the 16 prefixes' 256 blocks), so without the tier a
prefix is evicted before it comes back. Both engines run here, one after the other, in this process (LLM in_process,
to read the tier's own hit count); their outputs must be identical in float32 (--dtype float32).

    python benchmarks/kv_offload.py [--blocks 64] [--prefixes 16] [--rounds 4] [--note "a quiet machine"] [--out F]
"""
from __future__ import annotations

import argparse
import datetime
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402
from multimodal import machine  # noqa: E402

PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 256, 16, 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)


def workload(vocab: int, prefixes: int, rounds: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(3, vocab) for _ in range(PREFIX_LEN)] for _ in range(prefixes)]
    return [base + [rng.randrange(3, vocab) for _ in range(SUFFIX_LEN)] for _ in range(rounds) for base in bases]


def run(blocks: int, host_bytes: str | None, prompts: list[list[int]], dtype: str = "auto"
        ) -> tuple[str, float, float, list]:
    """One engine over the workload: its line, hit rate, output tokens a second, and its outputs."""
    llm = LLM(str(shipped_model("demo")), in_process=True, num_kv_blocks=blocks, kv_offload_bytes=host_bytes,
              dtype=dtype)
    try:
        warm_up = [random.Random(1).randrange(3, 4096) for _ in range(PREFIX_LEN)]  # shares no block with them
        llm.generate([{"prompt_token_ids": warm_up}], PARAMS, use_tqdm=False)
        kv = llm.client.engine.kv_cache_manager
        queries, hits, host_hits = kv.prefix_cache_queries, kv.prefix_cache_hits, kv.prefix_cache_host_hits
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        seconds = time.perf_counter() - start
        queries, hits = kv.prefix_cache_queries - queries, kv.prefix_cache_hits - hits
        host_hits = kv.prefix_cache_host_hits - host_hits
        host_blocks = kv.tier.num_slots if kv.tier is not None else 0
    finally:
        llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    rate = hits / max(1, queries)
    name = f"host tier {host_bytes} ({host_blocks} blocks)" if host_bytes else "no host tier"
    line = (f"{name:34s} hit rate {rate:6.1%} ({host_hits / max(1, queries):6.1%} from the host tier), "
            f"{generated / seconds:7.1f} output tok/s, {(generated + sum(map(len, prompts))) / seconds:8.1f} "
            f"total tok/s, {seconds:6.2f} s")
    return line, rate, generated / seconds, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="device KV blocks of 16 tokens")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--host", default="64MiB", help="kv_offload_bytes of the engine with the tier")
    parser.add_argument("--dtype", default="auto", help="float32: outputs must be identical (bf16's rounding "
                        "depends on what is computed together, with or without prefix reuse)")
    parser.add_argument("--note", default="A machine shared with other work while it ran: indicative figures only.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = workload(4096, args.prefixes, args.rounds)
    without, rate_without, speed_without, expected = run(args.blocks, None, prompts, args.dtype)
    print(without, flush=True)
    with_tier, rate_with, speed_with, outputs = run(args.blocks, args.host, prompts, args.dtype)
    print(with_tier, flush=True)
    differing = sum(a != b for a, b in zip(outputs, expected))
    if differing and args.dtype == "float32":
        raise SystemExit(f"outputs with the host tier differ from those without it ({differing} requests)")
    outputs_line = f"outputs: {differing} of {len(prompts)} requests differ with the tier" + (
        " (bf16: a prompt computed over reused blocks rounds otherwise than computed whole, as with any prefix "
        "cache hit; --dtype float32 requires them identical)" if differing else "")
    lines = [without, with_tier, f"with / without the tier: hit rate {rate_with:.1%} / {rate_without:.1%}, "
             f"output throughput {speed_with / speed_without:.2f}x", outputs_line]
    print("\n".join(lines[2:]))
    today = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"kv-offload-cpu-{today}.md"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    command = f"`python benchmarks/kv_offload.py --blocks {args.blocks} --prefixes {args.prefixes} --rounds " \
              f"{args.rounds} --host {args.host} --dtype {args.dtype}` on " \
              f"{machine(args.note, 'bfloat16' if args.dtype == 'auto' else args.dtype)}"
    out.write_text(f"# benchmarks/kv_offload.py, {today}, at {commit}\n\n{textwrap.fill(command, 120)}\n\n"
                   "```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
