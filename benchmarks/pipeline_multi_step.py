"""Multi-step calls across pipeline stages: decode output tokens/s of the Ray engine at pp=2 taking up to
`--steps` decode steps a call against one step a call, at batch 1 and a batch that fits one call (every request
in one batch, so no second batch overlaps the stages either way).

Both engines stay up side by side and take turns each round, so machine drift hits both alike; the figure is the
median over rounds of each engine's rate, and of their ratio.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from core.engine_core import EngineCore  # noqa: E402
from ipc import EngineConfig  # noqa: E402
from launch.make_model import make_model  # noqa: E402
from tp_decode import compare_in_turns  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny", help="the model maker's size (tiny, 30m, ...)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="num_scheduler_steps of the multi-step engine")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks are Ray processes; keep the engine's own thread off their cores
    model = str(make_model(Path.home() / ".cache" / "pagedserve" / "bench-models" / f"llama-{args.size}",
                           size=args.size))
    base = EngineConfig(model=model, pipeline_parallel_size=2, max_model_len=512, num_kv_blocks=512,
                        multi_step_budget_ms=None)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    engines = {"one step a call": EngineCore(msgspec.structs.replace(base, num_scheduler_steps=1)),
               f"up to {args.steps} a call": EngineCore(msgspec.structs.replace(base, num_scheduler_steps=args.steps))}
    compare_in_turns(engines, args.batches, args.rounds, 8, args.output_len)


if __name__ == "__main__":
    main()
