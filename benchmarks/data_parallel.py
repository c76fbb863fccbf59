"""Data parallel: prefix-aware routing against round robin, two engines against one, and what routing costs.

The workload (issue 55's): 8 shared prefixes of 256 tokens, 16 requests each (a 16-token suffix of its own, 16
output tokens, ignore_eos), in a seeded random order, sent through AsyncLLM at --rate requests a second (default:
all at once) on the shipped demo model. Each data-parallel engine gets --blocks KV blocks of 16 tokens: room for
about four prefixes and the requests running, so an engine that sees all eight evicts (one engine gets twice the
blocks). For each layout: each engine's prefix-cache hit rate (prompt tokens found / looked up), the total, the
output and total token throughput and the wall time. Then EngineBalancer.choose()'s time for a 1,024-token prompt:
the routing the front end adds to each request (the engines' clients are the same as with one engine).

    python benchmarks/data_parallel.py [--rate 64] [--blocks 80] [--note "a quiet machine"] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend import AsyncLLM, SamplingParams  # noqa: E402
from frontend.dp_balance import EngineBalancer  # noqa: E402
from ipc import EngineCoreRequest  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402
from multimodal import machine  # noqa: E402

PREFIXES, PER_PREFIX, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 8, 16, 256, 16, 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(SUFFIX_LEN)]
               for prefix in prefixes for _ in range(PER_PREFIX)]
    rng.shuffle(prompts)
    return prompts


async def serve(dp: int, routing: str, blocks: int, rate: float, prompts: list[list[int]]) -> list[str]:
    engine = AsyncLLM(str(shipped_model("demo")), data_parallel_size=dp, data_parallel_routing=routing,
                      num_kv_blocks=blocks)
    try:
        async def one(index: int) -> int:
            tokens = 0
            async for output in engine.generate({"prompt_token_ids": prompts[index]}, PARAMS, f"r{index}"):
                tokens = len(output.outputs[0].token_ids)
            return tokens

        start = time.perf_counter()
        tasks = []
        for index in range(len(prompts)):
            await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(index)))
        outputs = sum(await asyncio.gather(*tasks))
        seconds = time.perf_counter() - start
        clients = engine.client.clients if dp > 1 else [engine.client]
        stats = [await client.get_stats_async() for client in clients]
    finally:
        engine.shutdown()
    rates = [s.prefix_cache_hits / max(1, s.prefix_cache_queries) for s in stats]
    total = sum(s.prefix_cache_hits for s in stats) / max(1, sum(s.prefix_cache_queries for s in stats))
    prompt_tokens = sum(map(len, prompts))
    name = f"dp={dp} {routing if dp > 1 else ''}".strip()
    return [f"{name:22s} hit rate {total:6.1%} (per engine {', '.join(f'{r:.1%}' for r in rates)}), "
            f"{outputs / seconds:7.1f} output tok/s, {(outputs + prompt_tokens) / seconds:8.1f} total tok/s, "
            f"{seconds:6.2f} s", f"{total}"]


def routing_cost(repeats: int = 2000) -> str:
    balancer = EngineBalancer(2, 16)
    rng = random.Random(1)
    requests = [EngineCoreRequest(request_id=f"c{i}", prompt_token_ids=[rng.randrange(4096) for _ in range(1024)],
                                  sampling_params=PARAMS) for i in range(repeats)]
    times = []
    for request in requests:
        start = time.perf_counter()
        balancer.choose(request)
        times.append(time.perf_counter() - start)
        balancer.finished(request.request_id)
    return f"EngineBalancer.choose(), 1,024-token prompt: {statistics.median(times) * 1e6:.0f} us median " \
           f"({len(times)} calls)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=float("inf"),
                        help="requests sent a second (default: all at once, in the workload's order)")
    parser.add_argument("--blocks", type=int, default=80, help="KV blocks of each data-parallel engine")
    parser.add_argument("--note", default="A machine shared with other work while it ran: indicative figures only.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = workload(4096)
    lines, hit_rates = [], {}
    for dp, routing, blocks in ((1, "prefix", 2 * args.blocks), (2, "round_robin", args.blocks),
                                (2, "prefix", args.blocks)):
        line, rate = asyncio.run(serve(dp, routing, blocks, args.rate, prompts))
        print(line, flush=True)
        lines.append(line)
        hit_rates[(dp, routing)] = float(rate)
    ratio = hit_rates[(2, "prefix")] / max(1e-9, hit_rates[(2, "round_robin")])
    lines += [f"prefix-aware / round-robin hit rate: {ratio:.2f}x", routing_cost()]
    print("\n".join(lines[-2:]))
    today = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"data-parallel-cpu-{today}.md"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    command = f"`python benchmarks/data_parallel.py --rate {args.rate:g} --blocks {args.blocks}` on " \
              f"{machine(args.note)}".replace("float32. ", "bfloat16 (the demo's default). ")
    out.write_text(f"# benchmarks/data_parallel.py, {today}, at {commit}\n\n{textwrap.fill(command, 120)}\n\n"
                   "```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
