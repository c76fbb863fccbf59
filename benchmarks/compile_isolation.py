"""A schema that compiles for tens of seconds must not slow anyone else: the decode step time (TPOT) of plain
requests while it compiles vs the same requests on an idle engine, and when the slow request gets its timeout
error (an HTTP 400 at the gateway). One in-process engine core; default model: the shipped demo.

    python benchmarks/compile_isolation.py    # targets: TPOT within 20% of idle; the error <= timeout + 1 s
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.engine_core import EngineCore  # noqa: E402
from ipc import EngineConfig, EngineCoreRequest, SamplingParams, StructuredOutputsParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.shipped import shipped_model  # noqa: E402

TPOT_TARGET = 1.20
ERROR_SLACK_S = 1.0


def slow_schema(depth: int) -> dict:
    """Nested anyOf of objects and arrays: xgrammar's compile time grows steeply with depth (8: tens of seconds)."""
    schema: dict = {"type": "string", "title": f"fresh-{time.time_ns()}"}  # a schema no cache has seen
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {"a": schema, "b": schema}},
                            {"type": "array", "items": schema}]}
    return schema


def run_phase(engine: EngineCore, batch: int, max_tokens: int, slow: SamplingParams | None,
              tag: str) -> tuple[list[float], float | None, str | None]:
    """(durations of the steps where all plain requests decode, seconds until the slow request's final output, its
    error)."""
    plain = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=[10 + i, 20, 30, 40],
                                             sampling_params=plain))
    added = time.perf_counter()
    if slow is not None:
        engine.add_request(EngineCoreRequest(request_id=f"{tag}-slow", prompt_token_ids=[5, 6, 7],
                                             sampling_params=slow))
    steps, slow_done, slow_error, produced = [], None, None, {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for output in outputs:
            if output.request_id == f"{tag}-slow" and output.finish_reason is not None:
                slow_done, slow_error = time.perf_counter() - added, output.error
            produced[output.request_id] = produced.get(output.request_id, 0) + len(output.new_token_ids)
        decoding = sum(1 for i in range(batch) if 1 <= produced.get(f"{tag}-{i}", 0) < max_tokens)
        if decoding == batch:
            steps.append(elapsed)
    return steps, slow_done, slow_error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the shipped demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=3.0, help="--structured-outputs-compile-timeout")
    parser.add_argument("--depth", type=int, default=8, help="anyOf nesting of the slow schema")
    args = parser.parse_args()
    model = args.model or str(shipped_model("demo"))
    engine = EngineCore(EngineConfig(model=model, dtype=args.dtype, max_model_len=512,
                                     structured_outputs_compile_timeout=args.timeout))
    print(f"model {args.model or 'the shipped demo'}, {args.dtype}, batch {args.batch}, native bf16: "
          f"{cpu_has_native_bf16()}, compile timeout {args.timeout:g} s, anyOf depth {args.depth}")
    warm = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"), max_tokens=4)
    run_phase(engine, args.batch, 32, warm, "warm-up")  # vocabulary tables built, kernels warm
    idle, _, _ = run_phase(engine, args.batch, args.max_tokens, None, "idle")
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json=slow_schema(args.depth)), max_tokens=8)
    busy, error_after, error = run_phase(engine, args.batch, args.max_tokens, slow, "busy")
    engine.shutdown()
    idle_tpot, busy_tpot = statistics.median(idle), statistics.median(busy)
    ratio = busy_tpot / idle_tpot
    print(f"TPOT idle {idle_tpot * 1e3:.2f} ms, while the schema compiles {busy_tpot * 1e3:.2f} ms "
          f"(median over {len(idle)} / {len(busy)} steps; the phase lasted {sum(busy):.1f} s): {ratio:.3f}x, "
          f"target <= {TPOT_TARGET}")
    print(f"the slow request ended after {error_after:.2f} s (timeout {args.timeout:g} s): {error}")
    timely = error_after is not None and error_after <= args.timeout + ERROR_SLACK_S and "took longer" in (error or "")
    return 0 if ratio <= TPOT_TARGET and timely else 1


if __name__ == "__main__":
    sys.exit(main())
