"""Speculative decoding on the demo model: the same requests with and without it, in one run, and how many drafts
were accepted.

Workloads (held-out stdlib code the model never saw in training):
  edit  the prompt holds a stretch of code, then its first lines again: the output rewrites it (prompt lookup finds
        what comes next in the prompt)
  free  the prompt is the start of a file: the model continues on its own
Runs: edit with prompt lookup and free with the shipped draft model at batch 1 (requests one after another:
tokens per second of one stream), then both methods on one batch of --batch requests (where disable_by_batch_size
turns speculation off). Both engines of a run are loaded at once and take turns; each one's best round counts.
--device picks where they run ("auto": CUDA when torch sees a GPU).
Example:
    python benchmarks/spec_decode.py                      # k=7 (prompt lookup), 4 (draft); batch 1 and 64
    python benchmarks/spec_decode.py --requests 4 --batch 0
    python benchmarks/spec_decode.py --cutoff-sweep 1 2 4 8 16 32   # where disable_by_batch_size should cut in
    python benchmarks/spec_decode.py --method mtp   # DeepSeek-V3-shaped, its MTP layer drafting (k=--mtp-drafts)
    python benchmarks/spec_decode.py --temperature 0.8 --top-p 0.95 --batch 0   # sampled requests (seeded)
    python benchmarks/spec_decode.py --tp 2 --requests 4 --batch 0   # both engines over two ranks (or --pp 2)
--method mtp: a small DeepSeek-V3-shaped model trained with its multi-token-prediction layer on the demo corpus
(launch/train_mtp.py; trained into the benchmark cache on first use) continues the free workload with and without
the layer's drafts, at batch 1 and --batch; the acceptance by draft position is the figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from ipc import SpecDecodingStats  # noqa: E402
from launch.demo_corpus import split, stdlib_files  # noqa: E402
from launch import train_mtp  # noqa: E402
from launch.shipped import WEIGHTS_DIR  # noqa: E402
from launch.train_demo import HELD_OUT_FRACTION  # noqa: E402
import bench_device  # noqa: E402


def held_out_code(model: Path, count: int, lines: int) -> list[str]:
    """`count` distinct stretches of `lines` non-blank lines from the run's held-out files: one from a third of the
    way into each file first, then the files' other non-overlapping stretches in turn (a batch of 64 needs more than
    one per file)."""
    run = json.loads((model / "training_log.json").read_text())
    _, held = split(stdlib_files(), HELD_OUT_FRACTION, run["seed"])
    bodies = [body for source in held
              if len(body := [line for line in source.text.splitlines() if line.strip()]) >= 2 * lines]
    windows = [[len(body) // 3] + [start for start in range(0, len(body) - lines + 1, lines)
                                   if abs(start - len(body) // 3) >= lines] for body in bodies]
    stretches = []
    for turn in range(max(map(len, windows), default=0)):
        for body, starts in zip(bodies, windows):
            if turn < len(starts):
                stretches.append("\n".join(body[starts[turn]:starts[turn] + lines]) + "\n")
    if len(stretches) < count:
        raise SystemExit(f"the held-out files give {len(stretches)} stretches of {lines} lines, not {count}")
    return stretches[:count]


def prompts(workload: str, code: list[str]) -> list[str]:
    if workload == "edit":
        return [f"{text}\n# The same, with the comments kept:\n{''.join(text.splitlines(True)[:2])}" for text in code]
    return ["".join(text.splitlines(True)[:3]) for text in code]


def timed(llm: LLM, texts: list[str], params: SamplingParams, batch: bool) -> tuple[float, int]:
    """(seconds, output tokens): all at once, or one request after another."""
    start = time.perf_counter()
    groups = [texts] if batch else [[text] for text in texts]
    tokens = sum(len(o.outputs[0].token_ids) for group in groups
                 for o in llm.generate(group, params, use_tqdm=False))
    return time.perf_counter() - start, tokens


def since(before: SpecDecodingStats | None, after: SpecDecodingStats | None) -> SpecDecodingStats | None:
    """The counts between two snapshots (the measured run without its warm-up)."""
    if after is None:
        return None
    width = len(after.drafted_per_position)
    pad = (lambda values: values + [0] * (width - len(values)))
    return SpecDecodingStats(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        drafted_per_position=[a - b for a, b in zip(after.drafted_per_position, pad(before.drafted_per_position))],
        accepted_per_position=[a - b for a, b in zip(after.accepted_per_position, pad(before.accepted_per_position))])


def compare(args: argparse.Namespace, texts: list[str], batch: int, spec: dict, label: str) -> None:
    """Print the speed-up of `spec` over no speculation on `texts` (all at once past batch 1, else one by one) and
    its acceptance figures."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0 if args.temperature else None,
                            max_tokens=args.max_tokens, ignore_eos=True)
    engines = {name: LLM(str(args.model), dtype=args.dtype, in_process=True, speculative_config=config,
                         tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                         **bench_device.engine_args(args.device))
               for name, config in (("none", None), ("spec", spec))}
    for llm in engines.values():
        timed(llm, texts[:1], params, batch > 1)  # warm-up: kernels, allocator
    before = engines["spec"].get_stats().spec_decoding
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):  # taking turns, so a slow spell of this shared machine hits both
        for name, llm in engines.items():
            seconds, tokens = timed(llm, texts, params, batch > 1)
            rates[name].append(tokens / seconds)
    stats = since(before, engines["spec"].get_stats().spec_decoding)
    for llm in engines.values():
        llm.shutdown()
    plain, fast = max(rates["none"]), max(rates["spec"])
    ratios = sorted(b / a for a, b in zip(rates["none"], rates["spec"]))
    print(f"{label}: {plain:.1f} tok/s without, {fast:.1f} with (best of {args.rounds}): speedup {fast / plain:.2f}x; "
          f"median of the rounds' ratios {statistics.median(ratios):.2f}x (each: "
          f"{', '.join(f'{b / a:.2f}x' for a, b in zip(rates['none'], rates['spec']))})")
    if stats is not None and stats.num_drafts:
        by_position = [f"{a / d:.2f}" for a, d in zip(stats.accepted_per_position, stats.drafted_per_position)]
        print(f"  drafts {stats.num_drafts}, draft tokens {stats.num_draft_tokens}, accepted "
              f"{stats.num_accepted_tokens} (rate {stats.acceptance_rate:.2f}), tokens per verification step "
              f"{stats.mean_acceptance_length:.2f}, acceptance by position {by_position}")
    else:
        print("  no drafts verified")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=WEIGHTS_DIR / "demo")
    # 7 drafts: on the edit workload (2-core AVX-512 BF16 EPYC) 7 gave 1.61x where 4 gave 1.35x (same day), and
    # 1.58x where 11 gave 1.44x and 15 1.30x (same hour: longer drafts add few accepted tokens, 3.85 -> 4.18 per
    # verifying step at 15, for a dearer verification).
    parser.add_argument("--ngram-config", default='{"method": "ngram", "num_speculative_tokens": 7, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    parser.add_argument("--draft-config", default=json.dumps({"method": "draft_model", "num_speculative_tokens": 4,
                                                              "model": str(WEIGHTS_DIR / "draft")}))
    parser.add_argument("--requests", type=int, default=8, help="requests per batch-1 workload (0: none)")
    parser.add_argument("--batch", type=int, default=64, help="the batched runs' size (0: none)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="turns each engine takes; the best counts")
    parser.add_argument("--cutoff-sweep", type=int, nargs="*", default=[], metavar="BATCH",
                        help="instead: each method at these batch sizes with disable_by_batch_size off (where "
                             "speculation stops paying)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tp", type=int, default=1, help="both engines' tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="both engines' pipeline-parallel size")
    parser.add_argument("--method", choices=("ngram-draft", "mtp"), default="ngram-draft",
                        help="prompt lookup and the draft model on the demo (default), or MTP (see above)")
    parser.add_argument("--mtp-drafts", type=int, default=2)
    parser.add_argument("--mtp-steps", type=int, default=train_mtp.RECIPE["steps"], help="its training steps")
    args = parser.parse_args()
    if args.method == "mtp":
        args.model = train_mtp.ensure_mtp_model(args.mtp_steps)
    args.device = bench_device.resolve(args.device)
    if args.tp * args.pp > 1:  # both engines' ranks up at once: a Ray CPU each, whatever the machine has
        import ray
        ray.init(address="local", num_cpus=2 * args.tp * args.pp, include_dashboard=False,
                 _node_ip_address="127.0.0.1")
    warnings.filterwarnings("ignore")
    code = held_out_code(args.model, max(args.requests, args.batch, *args.cutoff_sweep), lines=12)
    configs = {"ngram": json.loads(args.ngram_config), "draft": json.loads(args.draft_config)}
    if args.method == "mtp":
        configs = {"mtp": {"method": "mtp", "num_speculative_tokens": args.mtp_drafts}}
    print(bench_device.describe(args.device))
    sampling = f"temperature {args.temperature}, top-p {args.top_p}" if args.temperature else "greedy"
    print(f"{args.model.name}, {sampling}, {args.max_tokens} tokens per request; {configs}")
    if args.cutoff_sweep:
        for workload, method in (("edit", "ngram"), ("free", "ngram"), ("free", "draft")):
            for batch in args.cutoff_sweep:
                texts = prompts(workload, code)[:args.requests if batch == 1 else batch]
                compare(args, texts, batch, {**configs[method], "disable_by_batch_size": None},
                        f"{workload} batch {batch} {method}, always speculating")
        return 0
    if args.method == "mtp":
        runs = ([("free", 1, "mtp")] if args.requests else []) + ([("free", args.batch, "mtp")] if args.batch else [])
    else:
        runs = [("edit", 1, "ngram"), ("free", 1, "draft")] if args.requests else []
        runs += [("free", args.batch, "ngram"), ("free", args.batch, "draft")] if args.batch else []
    for workload, batch, method in runs:
        texts = prompts(workload, code)[:args.requests if batch == 1 else batch]
        compare(args, texts, batch, configs[method], f"{workload} batch {batch} {method}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
