"""KV sharing: prefix caching on vs off (shared-prefix and zero-hit workloads), and peak KV blocks for n=4 and
beam width 4 with sharing vs the same work without. One run, in-process engines, bfloat16 benchmark model
(the model maker's random-weight ~30M llama).

Shared prefix: a 5-shot prompt of ~350 tokens + a short distinct question per request (the PagedAttention
paper's 5-shot case gained 3.58x); target >= 3.5x. Zero hit: random prompts that share nothing; target: caching
on costs <= 2%. Runs alternate on/off for --rounds rounds so drift on this noisy machine hits both alike; each
ratio is total requests over total seconds per setting.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402

SHARED_PREFIX_TARGET = 3.5
ZERO_HIT_MAX_SLOWDOWN = 0.02


def shared_prefix_prompts(args, vocab: int) -> list[dict]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, vocab) for _ in range(args.question_len)]}
            for _ in range(args.num_prompts)]


def zero_hit_prompts(args, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prefix_len + args.question_len)]}
            for _ in range(args.num_prompts)]


def timed_run(llm: LLM, prompts: list[dict], output_len: int) -> float:
    llm.reset_prefix_cache()  # every run starts cold: hits come only from sharing within the run
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def compare(engines: dict[str, LLM], make_prompts, args) -> dict:
    """Alternating timed runs of the same workload on each engine; requests/s per engine."""
    seconds = {name: 0.0 for name in engines}
    for round_index in range(args.rounds):
        prompts = make_prompts(round_index)
        for name, llm in engines.items():
            elapsed = timed_run(llm, prompts, args.output_len)
            seconds[name] += elapsed
            print(f"  round {round_index}: caching {name:3s} {len(prompts) / elapsed:7.2f} req/s", flush=True)
    return {name: args.rounds * args.num_prompts / s for name, s in seconds.items()}


def peak_blocks(model: str, args, prefix_caching: bool, work) -> int:
    llm = LLM(model, in_process=True, dtype=args.dtype, enable_prefix_caching=prefix_caching)
    work(llm)
    blocks = round(llm.get_stats().peak_kv_cache_usage * llm.info.num_kv_blocks)
    llm.shutdown()
    return blocks


def sharing_figures(model: str, args, vocab: int) -> dict:
    prompt = shared_prefix_prompts(args, vocab)[0]
    sampled = dict(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
    beam = BeamSearchParams(beam_width=4, max_tokens=args.output_len, ignore_eos=True)
    works = {
        "n=4": (lambda llm: llm.generate(prompt, SamplingParams(n=4, **sampled), use_tqdm=False),
                lambda llm: llm.generate([prompt] * 4, SamplingParams(**sampled), use_tqdm=False)),
        "beam width 4": (lambda llm: llm.beam_search(prompt, beam), lambda llm: llm.beam_search(prompt, beam)),
    }
    return {name: {"shared": peak_blocks(model, args, True, shared), "unshared": peak_blocks(model, args, False, alone)}
            for name, (shared, alone) in works.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the model maker's random ~30M llama)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--prefix-len", type=int, default=350)
    parser.add_argument("--question-len", type=int, default=20)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model = args.model or str(ensure_benchmark_model())
    engines = {"on": LLM(model, in_process=True, dtype=args.dtype),
               "off": LLM(model, in_process=True, dtype=args.dtype, enable_prefix_caching=False)}
    vocab = engines["on"].info.vocab_size
    print("shared prefix:")
    shared = compare(engines, lambda _: shared_prefix_prompts(args, vocab), args)
    print("zero hit:")
    zero = compare(engines, lambda round_index: zero_hit_prompts(args, vocab, seed=100 + round_index), args)
    for llm in engines.values():
        llm.shutdown()
    figures = {"shared_prefix_req_per_s": shared, "shared_prefix_speedup": shared["on"] / shared["off"],
               "zero_hit_req_per_s": zero, "zero_hit_slowdown": 1 - zero["on"] / zero["off"],
               "peak_kv_blocks": sharing_figures(model, args, vocab), "args": vars(args) | {"json": None}}
    print(f"shared prefix: caching on {shared['on']:.2f} req/s, off {shared['off']:.2f} req/s: "
          f"{figures['shared_prefix_speedup']:.2f}x (target >= {SHARED_PREFIX_TARGET}x)")
    print(f"zero hit: caching on {zero['on']:.2f} req/s, off {zero['off']:.2f} req/s: "
          f"caching costs {100 * figures['zero_hit_slowdown']:+.1f}% (negative: faster; "
          f"target <= {100 * ZERO_HIT_MAX_SLOWDOWN:.0f}%)")
    for name, blocks in figures["peak_kv_blocks"].items():
        print(f"peak KV blocks, {name}: {blocks['shared']} shared vs {blocks['unshared']} without sharing")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
