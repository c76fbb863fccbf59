"""The `pagedserve` command: generate text from a model folder (the built-in demo model when none is given)."""
from __future__ import annotations

import argparse
import sys

_DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--model", help="HF-format model folder (default: build and use the demo model)")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", help="bytes or a size like 4GiB")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-parallel-size", dest="pipeline_parallel_size", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from frontend import LLM, SamplingParams
    from launch.make_model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    try:
        llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  kv_cache_memory=args.kv_cache_memory, seed=args.seed,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        outputs = llm.generate(args.prompt or _DEFAULT_PROMPTS, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for output in outputs:
        completion = output.outputs[0]
        print(f"{output.prompt!r} -> {completion.text!r} [{completion.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
