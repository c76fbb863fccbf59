"""Beside a busy neighbour: the engine's speed on a quiet machine, beside one busy process, and restricted to one CPU.

For each family (llama: the fused C++ path; gemma2: the op-by-op path), the model maker's 30m model, offline
(`LLM.generate`, engine-core process): batch 1 (a 64-token prompt, 128 greedy tokens) and a batch of 32 (32 prompts
of 64, 96 tokens each), output tokens per second of wall time, best of --repeats (3). Then the same beside one busy
process (`python -c "while True: pass"`, started and ended here, unpinned, nice 0); then with the engine-core process
restricted to one CPU (every thread's affinity set to CPU 0 while it runs, as `taskset -a -p` does). The same for an
engine fixed at two threads (--cpu-threads 2, the count before it followed the machine), up beside the first: quiet
(no regression; the two engines' rounds alternate), beside the neighbour, and on one CPU (two threads fighting for one
core), timed once there (slow).
--compare-llamacpp runs llama.cpp's server on the llama model (a bf16 GGUF) quiet and beside the same neighbour.
Targets (issue 51): beside the neighbour >= 0.35x quiet; one CPU >= 0.4x quiet and never below the fixed two threads.

    python benchmarks/neighbour.py [--compare-llamacpp PATH/llama-server --gguf model-bf16.gguf]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp import complete, llamacpp_server  # noqa: E402

from frontend import LLM, SamplingParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402

PROMPT_TOKENS = 64
OUTPUTS = {1: 128, 32: 96}  # batch size -> output tokens per request
VOCAB_USED = 8000


def model_dir(arch: str) -> Path:
    """The model maker's 30m model of `arch`, made once into the benchmark cache."""
    return make_model(benchmark_cache_dir() / f"neighbour-{arch}", arch, "30m")


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this benchmark and benchmarks/feature_speed.py share: dtype, repeats and the llama.cpp peer."""
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-llamacpp", metavar="LLAMA_SERVER", help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", help="the llama 30m model as a GGUF (python -m launch.make_gguf ... --type bf16)")


def prompts(batch: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, VOCAB_USED) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


@contextlib.contextmanager
def busy_neighbour() -> Iterator[None]:
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def one_cpu(pid: int) -> Iterator[None]:
    """Every thread of process `pid` allowed CPU 0 only while the block runs (taskset -a -p 0x1 PID)."""
    tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    before = {task: os.sched_getaffinity(task) for task in tasks}
    for task in tasks:
        os.sched_setaffinity(task, {min(before[task])})
    try:
        yield
    finally:
        for task, cpus in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(task, cpus)


def tokens_per_second(run: Callable[[], int], repeats: int, warm_up: bool = True) -> float:
    """Output tokens per second of wall time, best of `repeats` (after one untimed run)."""
    return alternating_best({"run": run}, repeats, warm_up)["run"]


def alternating_best(runs: dict[str, Callable[[], int]], repeats: int, warm_up: bool = True,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each run's units (output tokens, calls: what it returns) per second of `clock` (wall time), best of `repeats`,
    the runs taking turns round by round so that the machine's drift hits them alike (after one untimed run each)."""
    if warm_up:
        for run in runs.values():
            run()
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, run in runs.items():
            start = clock()
            units = run()
            best[name] = max(best[name], units / (clock() - start))
    return best


def engine_run(llm: LLM, batch: int) -> Callable[[], int]:
    requests = [{"prompt_token_ids": p} for p in prompts(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUTS[batch], ignore_eos=True)

    def run() -> int:
        outputs = llm.generate(requests, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)
    return run


def llamacpp_run(base_url: str, batch: int) -> Callable[[], int]:
    def run() -> int:
        with ThreadPoolExecutor(batch) as pool:
            return sum(pool.map(lambda p: complete(base_url, p, OUTPUTS[batch]), prompts(batch)))
    return run


def engine_figures(model: Path, dtype: str, repeats: int) -> dict[str, dict[int, float]]:
    """The engine as it is and one fixed at two threads (the count before it followed the machine), both up at once:
    quiet figures alternate between them; beside the neighbour and on one CPU the fixed one is timed once (slow)."""
    figures: dict[str, dict[int, float]] = {name: {} for name in ("quiet", "busy", "one CPU", "2 threads, quiet",
                                                                   "2 threads, busy", "2 threads, one CPU")}
    llm = LLM(str(model), dtype=dtype)
    fixed = LLM(str(model), dtype=dtype, cpu_threads=2)
    try:
        for batch in OUTPUTS:
            quiet = alternating_best({"quiet": engine_run(llm, batch), "2 threads, quiet": engine_run(fixed, batch)},
                                     repeats)
            for name, speed in quiet.items():
                figures[name][batch] = speed
            with busy_neighbour():
                figures["busy"][batch] = tokens_per_second(engine_run(llm, batch), repeats)
                figures["2 threads, busy"][batch] = tokens_per_second(engine_run(fixed, batch), 1, warm_up=False)
            with one_cpu(llm.client.process.pid):
                figures["one CPU"][batch] = tokens_per_second(engine_run(llm, batch), repeats)
            with one_cpu(fixed.client.process.pid):
                figures["2 threads, one CPU"][batch] = tokens_per_second(engine_run(fixed, batch), 1, warm_up=False)
    finally:
        llm.shutdown()
        fixed.shutdown()
    return figures


def llamacpp_figures(server: str, gguf: str, repeats: int) -> dict[str, dict[int, float]]:
    figures: dict[str, dict[int, float]] = {"quiet": {}, "busy": {}}
    for batch in OUTPUTS:
        with llamacpp_server(server, gguf, batch, PROMPT_TOKENS + OUTPUTS[batch] + 16) as url:
            figures["quiet"][batch] = tokens_per_second(llamacpp_run(url, batch), repeats)
            with busy_neighbour():
                figures["busy"][batch] = tokens_per_second(llamacpp_run(url, batch), repeats)
    return figures


def report(name: str, figures: dict[str, dict[int, float]]) -> None:
    for batch in OUTPUTS:
        quiet = figures["quiet"][batch]
        line = f"{name:>9} batch {batch:>2}: quiet {quiet:8.1f} tok/s"
        for condition in ("busy", "one CPU", "2 threads, quiet", "2 threads, busy", "2 threads, one CPU"):
            if condition in figures:
                speed = figures[condition][batch]
                line += f" | {condition} {speed:8.1f} ({speed / quiet:.2f}x)"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["llama", "gemma2"])
    engine_arguments(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # transformers 5.x's deprecation chatter
    print(f"{os.cpu_count()} CPUs, native bf16: {cpu_has_native_bf16()}, dtype {args.dtype}; a quiet machine "
          "is assumed apart from the neighbour this benchmark starts", flush=True)
    if args.compare_llamacpp:
        report("llama.cpp", llamacpp_figures(args.compare_llamacpp, args.gguf, args.repeats))
    for arch in args.archs:
        report(arch, engine_figures(model_dir(arch), args.dtype, args.repeats))


if __name__ == "__main__":
    main()
