"""Per-step control-plane overhead of the Ray executor: decode-only steps of 1 and 64 requests on the tiny llama,
in-process tp=1 vs the Ray path at tp=1 (same compute: the difference is the control plane alone) and at tp=2
(adds the all-reduces and the logits gather, through shared memory between the two ranks). Target: the Ray path
adds <= 1 ms per step.

This VM's speed drifts by tens of percent between runs, so the three engines stay up side by side and take turns:
each round runs `--steps` decode steps on each engine, and the figure is the median over rounds of each round's
difference. Every engine runs one torch thread per rank, so the in-process and Ray tp=1 engines compute alike.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
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
from workers.executor import InProcessExecutor  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

TARGET_MS = 1.0
WARM_UP_STEPS = 6  # the prefill, then decodes


class DecodeEngine:
    """An engine core holding `batch` requests that decode for as many steps as the rounds need."""

    def __init__(self, config: EngineConfig, executor: type, batch: int, total_steps: int) -> None:
        with _executor_class(executor):
            self.engine = EngineCore(config)
        params = SamplingParams(temperature=0.0, max_tokens=total_steps + WARM_UP_STEPS + 1, ignore_eos=True)
        for i in range(batch):
            self.engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=[3 + i % 100] * 8,
                                                      sampling_params=params))
        self.median_step_ms(WARM_UP_STEPS)

    def median_step_ms(self, steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def shutdown(self) -> None:
        self.engine.shutdown()


@contextlib.contextmanager
def _executor_class(executor: type):
    """EngineCore picks Ray only for tp * pp > 1; the Ray tp=1 engine is built by hand."""
    import core.engine_core as engine_core

    default = engine_core._make_executor
    engine_core._make_executor = executor
    try:
        yield
    finally:
        engine_core._make_executor = default


def measure(model: str, batch: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Per round, the median step time of each engine, run one after the other."""
    # One decode step per call: the Ray path runs no multi-step calls, so the in-process engine must not either (with
    # its default of 8 it would run out of tokens in an eighth of the steps and time empty ones).
    base = EngineConfig(model=model, dtype="float32", num_kv_blocks=1024, max_model_len=1024, num_scheduler_steps=1)
    setups = {"in-process tp=1": (base, InProcessExecutor), "Ray tp=1": (base, RayExecutor),
              "Ray tp=2": (msgspec.structs.replace(base, tensor_parallel_size=2), RayExecutor)}
    engines: dict[str, DecodeEngine] = {}
    try:
        for name, (config, executor) in setups.items():
            engines[name] = DecodeEngine(config, executor, batch, steps * rounds)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                times[name].append(engine.median_step_ms(steps))
        return times
    finally:
        for engine in engines.values():
            engine.shutdown()


def report(batch: int, times: dict[str, list[float]]) -> None:
    local = times["in-process tp=1"]
    print(f"batch {batch:3d}: median over {len(local)} rounds of each round's median step")
    print(f"  in-process tp=1 {statistics.median(local):.3f} ms/step")
    for name, note in (("Ray tp=1", "control plane alone"), ("Ray tp=2", "control plane + all-reduces")):
        added = statistics.median(t - base for t, base in zip(times[name], local))
        quartiles = statistics.quantiles([t - base for t, base in zip(times[name], local)], n=4)
        verdict = "met" if added <= TARGET_MS else "not met"
        print(f"  {name:<8} {statistics.median(times[name]):.3f} ms/step: {added:+.3f} ms added ({note}; "
              f"target <= {TARGET_MS} ms: {verdict}); rounds' quartiles {quartiles[0]:+.3f} / {quartiles[2]:+.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per engine per round")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = str(make_model(Path.home() / ".cache" / "pagedserve" / "bench-models" / "llama-tiny", size="tiny"))
    # A logical CPU for each of the three Ray ranks (tp=1 and tp=2 engines are up at once).
    ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        for batch in args.batches:
            report(batch, measure(model, batch, args.steps, args.rounds))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
