"""Data parallel with expert-parallel MoE: two engines holding half the experts each against two holding all of them
and one engine, on a random-weight Mixtral (8 experts, top 2) of the 30m shapes, float32.

The workload: --requests requests of a --prompt-len token prompt of their own and --output-len output tokens
(ignore_eos), all given to LLM.generate at once. For each layout: the weights each engine holds, the output token
throughput, the wall time and the ratio to one engine. With experts split, every MoE layer of every step exchanges
the engines' tokens (three gloo collectives) and the engines step together (docs/parallel.md).

    python benchmarks/dp_expert_parallel.py [--requests 32] [--prompt-len 64] [--output-len 32]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402

LAYOUTS = (("1 engine", {}), ("2 engines, all experts each", {"data_parallel_size": 2}),
           ("2 engines, experts split (EP)", {"data_parallel_size": 2, "enable_expert_parallel": True}))


def run(model: str, layout: dict, prompts: list[dict], params: SamplingParams) -> tuple[float, list[int], list]:
    llm = LLM(model, dtype="float32", data_parallel_routing="round_robin", **layout)
    try:
        clients = getattr(llm.client, "clients", [llm.client])
        held = [client.info.weight_bytes for client in clients]
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, held, [output.outputs[0].token_ids for output in outputs]
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    model = str(make_model(benchmark_cache_dir() / "mixtral-30m-8experts", arch="mixtral", size="30m",
                           num_local_experts=8))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    base, reference = None, None
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, float32")
    for name, layout in LAYOUTS:
        seconds, held, tokens = run(model, layout, prompts, params)
        base = base or seconds
        reference = reference or tokens
        throughput = args.requests * args.output_len / seconds
        print(f"{name:32s} weights per engine {', '.join(f'{b / 2**20:.0f} MiB' for b in held):18s} "
              f"{throughput:8.1f} output tok/s  {seconds:6.2f} s  x{base / seconds:.2f}  "
              f"greedy equal to 1 engine: {tokens == reference}")


if __name__ == "__main__":
    main()
