"""Disaggregated prefill (--kv-transfer-config): the streams' inter-token latency while long prompts arrive, with a
prefill and a decode engine against the same two engines as plain data parallel, in the same run.

The workload (issue 57's): --streams requests of a 32-token prompt decode --stream-tokens tokens each (greedy,
ignore_eos); once all have started, --long prompts of --long-len tokens arrive one every --interval s, each generating
8 tokens. Each configuration is two engine cores on this machine, each pinned to its own share of the CPUs (one core
each on two), behind one AsyncLLM: plain DP routed round robin, plain DP routed by prefix, and disaggregated (engine
0 prefills, engine 1 decodes) with the KV handed over shared memory and over ZMQ (loopback TCP). Engines run
--num-scheduler-steps 1 by default, so each token reaches its stream as its step ends and a stall shows whole (a
multi-step call would hold tokens back and deliver them together either way). A stream's inter-token latency: the gap
before each of its outputs, spread over the tokens it brings; its first output (time to first token) is left out.

    python benchmarks/disagg_prefill.py [--streams 4] [--long 8] [--long-len 448] [--interval 0.25]
        [--num-scheduler-steps 1] [--note ...]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend import AsyncLLM, SamplingParams  # noqa: E402
from ipc import RequestOutputKind  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402
from multimodal import machine  # noqa: E402

CONNECTOR = {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "kv_buffer_bytes": "256MiB"}
CONFIGS = {"plain DP, round robin": {"data_parallel_routing": "round_robin"},
           "plain DP, prefix routing": {"data_parallel_routing": "prefix"},
           "disaggregated prefill": {"kv_transfer_config": CONNECTOR},
           "disaggregated prefill, ZMQ": {"kv_transfer_config": {**CONNECTOR, "kv_connector": "ZmqConnector"}}}


async def stream(engine: AsyncLLM, request_id: str, ids: list[int], params: SamplingParams,
                 gaps: list[float] | None = None, started: asyncio.Event | None = None) -> None:
    """Run one request; with `gaps`, add each output's gap since the one before, once per token it brings."""
    last = None
    async for output in engine.generate({"prompt_token_ids": ids}, params, request_id):
        now, count = time.perf_counter(), len(output.outputs[0].token_ids)
        if gaps is not None and last is not None and count:
            gaps += [(now - last) / count] * count
        last = now
        if started is not None:
            started.set()


async def run(name: str, engine_args: dict, args: argparse.Namespace, vocab: int) -> list[float]:
    """One configuration over the workload: the streams' inter-token gaps (s)."""
    rng = random.Random(0)
    engine = AsyncLLM(str(shipped_model("demo")), data_parallel_size=2, num_scheduler_steps=args.num_scheduler_steps,
                      **engine_args)
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        await asyncio.gather(*(stream(engine, f"warm{i}", [rng.randrange(3, vocab) for _ in range(64)], warm)
                               for i in range(4)))
        params = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        gaps: list[float] = []
        started = [asyncio.Event() for _ in range(args.streams)]
        streams = [asyncio.ensure_future(stream(engine, f"s{i}", [rng.randrange(3, vocab) for _ in range(32)], params,
                                                gaps, started[i])) for i in range(args.streams)]
        await asyncio.gather(*(event.wait() for event in started))
        long = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = []
        for i in range(args.long):
            ids = [rng.randrange(3, vocab) for _ in range(args.long_len)]
            prompts.append(asyncio.ensure_future(stream(engine, f"long{i}", ids, long)))
            await asyncio.sleep(args.interval)
        await asyncio.gather(*streams, *prompts)
        stats = await engine.get_stats()
    finally:
        engine.shutdown()
    print(f"{name:26s} inter-token latency p50 {percentile(gaps, 50) * 1e3:7.2f} ms, p99 "
          f"{percentile(gaps, 99) * 1e3:7.2f} ms over {len(gaps)} tokens; KV blocks transferred "
          f"{stats.kv_transfer_blocks_received}, recomputed transfers {stats.kv_transfer_recomputes}", flush=True)
    return gaps


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=400, help="each stream's output (demo model: 512 ctx)")
    parser.add_argument("--long", type=int, default=8, help="long prompts arriving while the streams decode")
    parser.add_argument("--long-len", type=int, default=448)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between long prompts")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per engine call")
    parser.add_argument("--note", default="A quiet machine is assumed (nothing else running).",
                        help="what to print about the machine's load")
    args = parser.parse_args()
    print(machine(args.note, "bfloat16"), flush=True)
    results = {name: asyncio.run(run(name, engine_args, args, 4096)) for name, engine_args in CONFIGS.items()}
    for disaggregated in list(CONFIGS)[2:]:
        for name in list(CONFIGS)[:2]:
            ratios = [percentile(results[disaggregated], q) / percentile(results[name], q) for q in (50, 99)]
            print(f"{disaggregated} / {name}: p50 {ratios[0]:.2f}x, p99 {ratios[1]:.2f}x")


if __name__ == "__main__":
    main()
