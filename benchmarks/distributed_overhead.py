"""Per-step control-plane overhead of the Ray executor: decode-only steps of 1 and 64 requests on the tiny llama,
in-process tp=1 vs the Ray path at tp=1 (same compute: the difference is the control plane alone) and at tp=2
(adds the all-reduces and the logits gather, through shared memory between the two ranks). Target: the Ray path
adds <= 1 ms per step.

Every engine runs one torch thread per rank, so the in-process and Ray tp=1 engines compute alike.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import core.engine_core as engine_core  # noqa: E402
from core.engine_core import EngineCore  # noqa: E402
from ipc import EngineConfig, EngineCoreRequest, SamplingParams  # noqa: E402
from launch.make_model import make_model  # noqa: E402
from workers.executor import InProcessExecutor  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

TARGET_MS = 1.0


def median_step_ms(config: EngineConfig, use_ray: bool, batch: int, steps: int) -> float:
    """Median wall time of `steps` decode-only steps after one prefill step and a few warm-up steps."""
    engine_core._make_executor = RayExecutor if use_ray else InProcessExecutor  # tp=1 on Ray: pick it by hand
    engine = EngineCore(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
        for i in range(batch):
            engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=[3 + i % 100] * 8,
                                                 sampling_params=params))
        for _ in range(6):  # the prefill, then warm-up decodes
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = str(make_model(Path.home() / ".cache" / "pagedserve" / "bench-models" / "llama-tiny", size="tiny"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        for batch in args.batches:
            base = EngineConfig(model=model, dtype="float32", num_kv_blocks=1024, max_model_len=512)
            local = median_step_ms(base, False, batch, args.steps)
            ray_tp1 = median_step_ms(base, True, batch, args.steps)
            ray_tp2 = median_step_ms(msgspec.structs.replace(base, tensor_parallel_size=2), True, batch, args.steps)
            print(f"batch {batch:3d}: in-process tp=1 {local:.3f} ms/step | Ray tp=1 {ray_tp1:.3f} ms/step "
                  f"(+{ray_tp1 - local:.3f} ms control plane, target <= {TARGET_MS}) | Ray tp=2 {ray_tp2:.3f} "
                  f"ms/step (+{ray_tp2 - local:.3f} ms incl. all-reduces)")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
