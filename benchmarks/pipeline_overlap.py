"""Pipeline parallelism with batches in flight: offline throughput of the Ray engine at pp=2 keeping 2 batches in
flight (the default) vs 1 at a time, with the in-process engine (tp=pp=1, 2 torch threads) as the peer.

One torch thread per pp rank, so pp=2 uses the machine's 2 cores only when both stages compute at once, which is
what batches in flight make possible. Rounds alternate so machine drift hits every variant alike.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from core.engine_core import EngineCore  # noqa: E402
from ipc import EngineConfig, EngineCoreRequest, SamplingParams  # noqa: E402
from launch.make_model import make_model  # noqa: E402


def output_tokens_per_s(config: EngineConfig, depth: int | None, args: argparse.Namespace) -> float:
    """Run every request to the end; depth overrides how many batches the executor keeps in flight."""
    engine = EngineCore(config)
    try:
        if depth is not None:
            engine.executor.max_concurrent_batches = depth
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i in range(args.num_requests):
            prompt = [(7 * i + j) % 8000 + 3 for j in range(args.input_len)]
            engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
        start = time.perf_counter()
        num_tokens = 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(output.new_token_ids) for output in engine.step())
        return num_tokens / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = str(make_model(Path.home() / ".cache" / "pagedserve" / "bench-models" / "llama-30m", size="30m"))
    base = EngineConfig(model=model, max_model_len=512, num_kv_blocks=1024)
    pp2 = msgspec.structs.replace(base, pipeline_parallel_size=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    results: dict[str, list[float]] = {"in-process tp=pp=1": [], "pp=2, 2 in flight": [], "pp=2, 1 in flight": []}
    try:
        for _ in range(args.rounds):
            torch.set_num_threads(2)
            results["in-process tp=pp=1"].append(output_tokens_per_s(base, None, args))
            torch.set_num_threads(1)  # the Ray ranks are separate processes; keep the driver off the cores
            results["pp=2, 2 in flight"].append(output_tokens_per_s(pp2, None, args))
            results["pp=2, 1 in flight"].append(output_tokens_per_s(pp2, 1, args))
    finally:
        ray.shutdown()
    mean = {name: sum(runs) / len(runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(f"{name:20s} {mean[name]:8.1f} output tok/s  (runs: {', '.join(f'{r:.1f}' for r in runs)})")
    print(f"batches in flight vs one at a time: {mean['pp=2, 2 in flight'] / mean['pp=2, 1 in flight']:.2f}x; "
          f"pp=2 in flight vs in-process: {mean['pp=2, 2 in flight'] / mean['in-process tp=pp=1']:.2f}x")


if __name__ == "__main__":
    main()
