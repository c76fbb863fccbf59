"""Decode at tensor parallel 2 (or, with --pp, two pipeline stages) against one rank, through the engine: output
tokens/s of the Ray engine at tp=2 (a rank a CPU, the C++ layers summing over shared memory) and of the in-process
engine at tp=1 (both CPUs its threads), at batch 1 and a larger batch; the same model, bf16, greedy, multi-step
calls on.

Both engines stay up side by side and take turns each round, so machine drift hits both alike; the figure is the
median over rounds of each engine's rate, and of their ratio (two ranks / one: 1.0 is the same speed from the same
CPUs, which is what the fast path over several ranks aims at).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import ray  # noqa: E402

from core.engine_core import EngineCore  # noqa: E402
from ipc import EngineConfig, EngineCoreRequest, SamplingParams  # noqa: E402
from launch.make_model import make_model  # noqa: E402


def output_tokens_per_s(engine: EngineCore, batch: int, prompt_len: int, output_len: int, tag: str) -> float:
    """`batch` requests decoded to `output_len` tokens each; tokens/s from the first token on."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", sampling_params=params,
                                             prompt_token_ids=[(7 * i + j) % 900 + 3 for j in range(prompt_len)]))
    num_tokens = sum(len(output.new_token_ids) for output in engine.step())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += sum(len(output.new_token_ids) for output in engine.step())
    return (num_tokens - batch) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="llama", help="the model maker's family (llama, qwen3, mixtral, ...)")
    parser.add_argument("--size", default="30m", help="the model maker's size (tiny, 30m, 100m)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pp", action="store_true", help="two pipeline stages instead of two tensor-parallel ranks")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # HF transformers 5.x's notices
    model = str(make_model(Path.home() / ".cache" / "pagedserve" / "bench-models" / f"{args.arch}-{args.size}",
                           arch=args.arch, size=args.size))
    base = EngineConfig(model=model, dtype="bfloat16", max_model_len=512, num_kv_blocks=1024)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    label, layout = ("pp=2", {"pipeline_parallel_size": 2}) if args.pp else ("tp=2", {"tensor_parallel_size": 2})
    engines = {"tp=1": EngineCore(base), label: EngineCore(msgspec.structs.replace(base, **layout))}
    compare_in_turns(engines, args.batches, args.rounds, args.prompt_len, args.output_len)


def compare_in_turns(engines: dict[str, EngineCore], batches: list[int], rounds: int, prompt_len: int,
                     output_len: int) -> None:
    """Two engines' output tokens/s at each batch, taking turns each round, and the second's over the first's (the
    medians over rounds); shuts the engines and Ray down after."""
    try:
        for batch in batches:
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for round_ in range(rounds):
                for name, engine in engines.items():
                    rates[name].append(output_tokens_per_s(engine, batch, prompt_len, output_len, f"{batch}-{round_}"))
            first, second = rates.values()
            medians = "; ".join(f"{name} {statistics.median(r):.1f} tok/s" for name, r in rates.items())
            ratio = statistics.median(b / a for a, b in zip(first, second))
            print(f"batch {batch}: {medians}; {' / '.join(reversed(rates))} {ratio:.2f}x (median of {rounds} rounds)",
                  flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
