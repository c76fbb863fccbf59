"""Structured output's cost: throughput with a JSON-schema constraint on every request vs the same requests
unconstrained (each given exactly the token count its constrained twin produced, ignore_eos), one in-process
engine, --batch requests at once, rounds alternated; the time spent filling masks per engine step; and the
latency a new schema's compile adds to its first request vs a cached one. Default model: the shipped demo.

    python benchmarks/structured_output.py                   # target: constrained >= 0.85x unconstrained
    python benchmarks/structured_output.py --backend guidance  # a schema routed to llguidance instead
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.structured_output import manager as manager_module  # noqa: E402
from frontend import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402

TARGET = 0.85
# A record as an API would return it: xgrammar enforces every keyword here.
XGRAMMAR_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_ ]{0,23}$"},
    "tags": {"type": "array", "items": {"enum": ["io", "net", "math", "text", "test"]}, "minItems": 1,
             "maxItems": 4},
    "active": {"type": "boolean"}}, "required": ["id", "name", "tags", "active"], "additionalProperties": False}
# The same record with maxLength instead of a pattern: routed to llguidance.
GUIDANCE_SCHEMA = {**XGRAMMAR_SCHEMA, "properties": {**XGRAMMAR_SCHEMA["properties"],
                                                     "name": {"type": "string", "maxLength": 24}}}


class MaskTimer:
    """Wall time of StructuredOutputManager.bitmask (the engine loop's per-step mask filling), in process."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        original = manager_module.StructuredOutputManager.bitmask

        def timed(manager, *args):
            start = time.perf_counter()
            result = original(manager, *args)
            if result is not None:
                self.seconds += time.perf_counter() - start
                self.steps += 1
            return result
        manager_module.StructuredOutputManager.bitmask = timed


def prompts(batch: int) -> list[str]:
    return [f"record {i}: {{" if i % 2 else f"# entry {i}\n" for i in range(batch)]


def constrained_run(llm: LLM, schema: dict, batch: int, seed: int) -> tuple[float, list[int]]:
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=0.8,
                             seed=seed * 1000 + i, max_tokens=256) for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts(batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for output in outputs:
        json.loads(output.outputs[0].text)  # each one is a finished, valid record
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def unconstrained_run(llm: LLM, lengths: list[int], seed: int) -> float:
    params = [SamplingParams(temperature=0.8, seed=seed * 1000 + i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(lengths)]
    start = time.perf_counter()
    llm.generate(prompts(len(lengths)), params, use_tqdm=False)
    return time.perf_counter() - start


def compile_latency(llm: LLM, schema: dict) -> tuple[float, float, float]:
    """(plain request, first request with a new schema, the same schema again) latencies, one output token."""
    def timed(params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate("x", params, use_tqdm=False)
        return time.perf_counter() - start
    fresh = {**schema, "title": f"fresh-{time.time_ns()}"}  # a schema no cache has seen
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json=fresh), max_tokens=1)
    return timed(SamplingParams(max_tokens=1)), timed(constrained), timed(constrained)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the shipped demo model)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", choices=("xgrammar", "guidance"), default="xgrammar")
    args = parser.parse_args()
    schema = XGRAMMAR_SCHEMA if args.backend == "xgrammar" else GUIDANCE_SCHEMA
    timer = MaskTimer()
    llm = LLM(args.model or str(shipped_model("demo")), dtype=args.dtype, in_process=True)
    print(f"model {args.model or 'the shipped demo'}, {args.dtype}, batch {args.batch}, backend {args.backend}, "
          f"native bf16: {cpu_has_native_bf16()}")
    plain, first, cached = compile_latency(llm, schema)
    print(f"latency of a 1-token request: plain {plain * 1e3:.1f} ms, new schema {first * 1e3:.1f} ms "
          f"(compile ~{(first - plain) * 1e3:.1f} ms), cached schema {cached * 1e3:.1f} ms")
    constrained_run(llm, schema, args.batch, seed=99)  # warm-up, both paths
    timer.seconds = timer.steps = 0
    ratios, tokens, with_s, without_s = [], 0, 0.0, 0.0
    for round_index in range(args.rounds):
        elapsed, lengths = constrained_run(llm, schema, args.batch, round_index)
        plain_elapsed = unconstrained_run(llm, lengths, round_index)
        ratios.append(plain_elapsed / elapsed)
        tokens, with_s, without_s = tokens + sum(lengths), with_s + elapsed, without_s + plain_elapsed
        print(f"  round {round_index}: {sum(lengths)} tokens, constrained {sum(lengths) / elapsed:7.1f} tok/s, "
              f"unconstrained {sum(lengths) / plain_elapsed:7.1f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
    ratio = without_s / with_s
    print(f"constrained / unconstrained throughput: {ratio:.3f} (rounds: median {statistics.median(ratios):.3f}); "
          f"target >= {TARGET}")
    print(f"mask filling: {timer.seconds / max(1, timer.steps) * 1e3:.2f} ms per step over {timer.steps} steps "
          f"({timer.seconds / with_s * 100:.1f}% of the constrained runs' time)")
    llm.shutdown()
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
