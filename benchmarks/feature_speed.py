"""Every model family and every request feature against plain llama: batch-1 decode and batch-32 throughput.

Each family at the model maker's 30m size (random weights), each feature on llama 30m, offline (`LLM.generate`,
engine-core process), bf16 unless --dtype. Batch 1: a 64-token prompt, 128 tokens; batch 32: 32 prompts of 64, 96
tokens each; output tokens per second of wall time, best of --repeats after one untimed run. Each row's speed is
normalised by what a token costs it:
- batch 1 as GB/s of the weights a token reads: every layer's, the final norm and the LM head (the embedding gives one
  row); of a mixture of experts the shared experts and the top-k routed ones' share of all experts' bytes;
- batch 32 as GFLOP/s of the products: 2 x those matrices' elements per token (attention's scores left out).
A mixture's row also prints both figures with every expert counted, as the issue's table counted them (it flatters
those families: a token reads only its top-k), and its batch-1 GB/s beside its dense twin's: a llama as wide and as
deep whose MLP is widened until its weights total the mixture's (residency.dense_reference), taking the same turns. A
token's experts change from token to token, so all of a mixture's weights must stay cached for its bytes to come
from the cache; where plain llama's fit in the last-level cache and a mixture's do not, the share of plain llama's
measures the cache, the share of the twin's (the same working set on the dense fast path) measures the mixture's path.
The share is a row's figure over plain llama's measured in turns with it (one llama engine stays up all run; each
row's engine and it take turns round by round, so the host's drift hits both alike). Quantized rows count the bytes
and products of the model dtype, so the int8 row's share is its speed over the bf16 model's (the int4 row's: a GPTQ
checkpoint's).
--compare-llamacpp adds llama.cpp's server on plain llama (a GGUF of the same model, --gguf), in turns with ours.
--int8-beyond-cache adds int8 against bf16 at batch 1 on a llama whose int8 weights are 1.5x the last-level cache
(the 30m model's fit in a large L3, where a step is not bound by the bytes it reads): the two engines take turns. Both
keep their paired copies only within workers.prepacking's budget (an eighth of the memory free at load: 13 GB free
or more on a 480 MiB L3), else they read their plain weights.
Target (issue 52): every row >= 0.8x plain llama's at batch 1 and batch 32, on a 2-core CPU with native bf16;
int8 >= 1.5x bf16 at batch 1 and >= 0.9x at batch 32.

    python benchmarks/feature_speed.py [--rows qwen3 logprobs ...] [--compare-llamacpp PATH/llama-server --gguf F]
                                       [--int8-beyond-cache]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp import llamacpp_server  # noqa: E402
from lora import write_adapter  # noqa: E402
from neighbour import (OUTPUTS, PROMPT_TOKENS, alternating_best, engine_arguments, llamacpp_run,  # noqa: E402
                       model_dir, prompts, tokens_per_second)
from residency import (BEYOND_CACHE_HIDDEN, beyond_cache_model, dense_reference,  # noqa: E402
                       is_mixture_of_experts, last_level_cache_bytes, per_token_cost, weight_elements)

from frontend import LLM, SamplingParams  # noqa: E402
from ipc.lora import LoRARequest  # noqa: E402
from ipc.structured_outputs import StructuredOutputsParams  # noqa: E402
from kernels import cpu_extension  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.fp8_blocks import fp8_block_checkpoint  # noqa: E402
from launch.make_model import ARCHS  # noqa: E402

LORA_RANK = 16


@dataclass(frozen=True)
class Row:
    """A benchmark row: a family's model, the engine's settings and each request's sampling settings."""

    arch: str = "llama"
    engine: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    adapter: bool = False
    fp8_blocks: bool = False  # projections stored as DeepSeek-V3's 128 x 128 FP8 blocks (launch/fp8_blocks.py)
    int4_group: int = 0  # projections stored as GPTQ 4-bit with zero points per group of this many columns


FEATURES = {
    "logprobs 5": Row(sampling={"logprobs": 5}),
    "presence + repetition penalty": Row(sampling={"presence_penalty": 0.5, "repetition_penalty": 1.2}),
    "regex constraint": Row(sampling={"structured_outputs": StructuredOutputsParams(regex="[a-z ,.]+")}),
    "int8 weights": Row(engine={"quantization": "int8"}),
    "fp8 block weights": Row(fp8_blocks=True),
    "int4 weights (group 128)": Row(int4_group=128),
    f"LoRA rank {LORA_RANK}": Row(engine={"enable_lora": True, "max_lora_rank": LORA_RANK}, adapter=True),
    "sampled (t 0.8, top-p 0.9, top-k 50)": Row(sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 0}),
}
ROWS = {"llama": Row(), **{arch: Row(arch) for arch in ARCHS if arch != "llama"}, **FEATURES}


def row_engine(row: Row, dtype: str, adapter_dir: Path) -> tuple[LLM, LoRARequest | None]:
    """The row's engine (its checkpoint written first where the row stores its weights its own way) and adapter."""
    folder = str(model_dir(row.arch))
    if row.fp8_blocks:
        folder, _ = fp8_block_checkpoint(folder, adapter_dir, (128, 128), with_reference=False)
    if row.int4_group:
        folder = int4_checkpoint(folder, adapter_dir, row.int4_group)
    lora = LoRARequest("bench", 1, write_adapter(adapter_dir, folder, LORA_RANK, 0)) if row.adapter else None
    return LLM(folder, dtype=dtype, **row.engine), lora


def batch_run(llm: LLM, row: Row, batch: int, lora: LoRARequest | None) -> Callable[[], int]:
    """One timed unit of the workload at `batch`: its requests generated to their full length."""
    requests = [{"prompt_token_ids": p} for p in prompts(batch)]
    params = SamplingParams(**{"temperature": 0.0, **row.sampling}, max_tokens=OUTPUTS[batch], ignore_eos=True)
    return _generate(llm, requests, params, lora)


def speeds_beside_llama(name: str, llama: LLM, dtype: str, repeats: int, tmp: Path) -> dict[int, dict[str, float]]:
    """batch -> {"row": the row's tok/s, "llama": plain llama's, and at batch 1 of a mixture of experts "dense": its
    dense twin's (residency.dense_reference)}, the engines taking turns round by round: these hosts' speed swings
    within minutes, and a share is only as good as its figures' nearness in time."""
    row = ROWS[name]
    llm, lora = row_engine(row, dtype, tmp / name.replace(" ", "_"))
    folder = model_dir(row.arch)
    twin = LLM(str(dense_reference(folder)), dtype=dtype) if is_mixture_of_experts(folder) else None
    try:
        speeds = {}
        for batch in OUTPUTS:
            runs = {"row": batch_run(llm, row, batch, lora), "llama": batch_run(llama, ROWS["llama"], batch, None)}
            if twin and batch == 1:
                runs["dense"] = batch_run(twin, ROWS["llama"], batch, None)
            for run in runs.values():
                run()
            settle()
            speeds[batch] = alternating_best(runs, repeats, warm_up=False)
        return speeds
    finally:
        llm.shutdown()
        if twin:
            twin.shutdown()


def settle(most_s: float = 30.0) -> None:
    """Wait (most_s at most) until all but half a CPU of the machine stays idle for half a second: a row's engine starts
    background work with its first requests (the grammar compile workers load for seconds on a CPU each), and
    llama's turns beside it would pay for it."""
    def idle_seconds() -> float:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle + iowait
    deadline, idle_cpus = time.monotonic() + most_s, (os.cpu_count() or 1) - 0.5
    while time.monotonic() < deadline:
        before = idle_seconds()
        time.sleep(0.5)
        if (idle_seconds() - before) / 0.5 >= idle_cpus:
            return


def int4_checkpoint(source: str, folder: Path, group: int) -> str:
    """A GPTQ 4-bit checkpoint of `source`, zero points per group of `group` columns, by the tests' writer
    (tests/quantized_checkpoints.py; imported here only: it brings the tests' fixtures)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quantized_checkpoints import gptq_checkpoint

    return gptq_checkpoint(source, folder, 4, group, act_order=False)[0]


def _generate(llm: LLM, requests: list[dict], params: SamplingParams, lora: LoRARequest | None
              ) -> Callable[[], int]:
    def run() -> int:
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        return sum(len(o.outputs[0].token_ids) for o in outputs)
    return run


def batch1_turns(engines: dict[str, dict], repeats: int) -> dict[str, float]:
    """Batch-1 decode tok/s of each engine (its LLM arguments), the engines taking turns (best of `repeats`)."""
    llms = {name: LLM(**arguments) for name, arguments in engines.items()}
    try:
        requests = [{"prompt_token_ids": p} for p in prompts(1)]
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUTS[1], ignore_eos=True)
        return alternating_best({name: _generate(llm, requests, params, None) for name, llm in llms.items()}, repeats)
    finally:
        for llm in llms.values():
            llm.shutdown()


def int8_beyond_cache(dtype: str, repeats: int) -> None:
    """Batch-1 decode of int8 against the model dtype on beyond_cache_model, the two engines taking turns."""
    cache = last_level_cache_bytes()
    folder = beyond_cache_model(cache)
    read, _ = per_token_cost(folder)
    speeds = batch1_turns({"bf16": {"model": str(folder), "dtype": dtype},
                           "int8": {"model": str(folder), "dtype": dtype, "quantization": "int8"}}, repeats)
    print(f"int8 beyond the last-level cache ({cache / 2**20:.0f} MiB; llama {BEYOND_CACHE_HIDDEN} wide, "
          f"{folder.name.rsplit('-', 1)[1]} layers: {read / 1e9:.2f} GB of {dtype}, {read / 2e9:.2f} GB of int8 a "
          f"token): batch 1 {dtype} {speeds['bf16']:6.2f} tok/s {speeds['bf16'] * read / 1e9:6.2f} GB/s | int8 "
          f"{speeds['int8']:6.2f} tok/s {speeds['int8'] * read / 2e9:6.2f} GB/s of int8 | int8 / {dtype} "
          f"{speeds['int8'] / speeds['bf16']:.2f}x", flush=True)


def figures(arch: str, speeds: dict[int, float]) -> tuple[float, float]:
    """(batch-1 GB/s, batch-32 GFLOP/s) of `arch`'s model at these tok/s (batch -> tok/s)."""
    read, products = per_token_cost(model_dir(arch))
    return speeds[1] * read / 1e9, speeds[32] * products / 1e9


def print_row(name: str, speeds: dict[int, float], llama_speeds: dict[int, float], dense: float = 0.0) -> None:
    """A row's tok/s and normalised figures, and their shares of plain llama's measured beside them (and of a mixture's
    dense twin's at batch 1: `dense` tok/s)."""
    folder = model_dir(ROWS[name].arch)
    row, base = figures(ROWS[name].arch, speeds), figures("llama", llama_speeds)
    print(f"{name:>38}: batch 1 {speeds[1]:7.1f} tok/s {row[0]:6.2f} GB/s ({row[0] / base[0]:.2f}x) | batch 32 "
          f"{speeds[32]:7.1f} tok/s {row[1]:6.1f} GFLOP/s ({row[1] / base[1]:.2f}x); llama beside it "
          f"{base[0]:6.2f} GB/s | {base[1]:6.1f} GFLOP/s", flush=True)
    if not is_mixture_of_experts(folder):
        return
    every = [speed * cost / 1e9 for speed, cost in zip((speeds[1], speeds[32]),
                                                        per_token_cost(folder, every_expert=True))]
    print(f"{'':>38}  every expert counted (the issue's table): {every[0]:6.2f} GB/s ({every[0] / base[0]:.2f}x)"
          f" | {every[1]:6.1f} GFLOP/s ({every[1] / base[1]:.2f}x)", flush=True)
    twin = dense_reference(folder)
    twin_gbps = dense * per_token_cost(twin)[0] / 1e9
    print(f"{'':>38}  batch 1 beside its dense twin ({twin.name}: {weight_elements(twin) * 2 / 2**20:.1f} MiB of "
          f"weights, the mixture {weight_elements(folder) * 2 / 2**20:.1f}): {twin_gbps:6.2f} GB/s "
          f"({row[0] / twin_gbps:.2f}x)", flush=True)


def llamacpp_beside(llama: LLM, server: str, gguf: str, repeats: int) -> None:
    """llama.cpp's server on plain llama's GGUF against our llama engine, the two taking turns at each batch."""
    for batch, output in OUTPUTS.items():
        with llamacpp_server(server, gguf, batch, PROMPT_TOKENS + output + 16) as url:
            best = alternating_best({"pagedserve": batch_run(llama, ROWS["llama"], batch, None),
                                     "llama.cpp": llamacpp_run(url, batch)}, repeats)
        print(f"llama.cpp's server, plain llama, batch {batch:>2}: {best['llama.cpp']:7.1f} tok/s, pagedserve "
              f"{best['pagedserve']:7.1f} tok/s in turns with it; pagedserve / llama.cpp "
              f"{best['pagedserve'] / best['llama.cpp']:.2f}x", flush=True)


def arguments_with_kernels(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line (with engine_arguments'), once the C++ kernels are built."""
    engine_arguments(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # transformers 5.x's deprecation chatter
    # Built (or found built) before any engine starts: an engine serves on the torch paths while its kernels build in
    # the background, and the first rows of a fresh machine's run measured those.
    if cpu_extension.load() is None:
        raise SystemExit("the C++ CPU kernels did not build: every row would measure the torch paths")
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="rows to measure (plain llama always runs: the others are shares of it)")
    parser.add_argument("--int8-beyond-cache", action="store_true",
                        help="also int8 against bf16 at batch 1 on a llama 1.5x the last-level cache (int8 bytes)")
    args = arguments_with_kernels(parser)
    print(f"{os.cpu_count()} CPUs, native bf16: {cpu_has_native_bf16()}, dtype {args.dtype}; batch 1 = "
          f"{PROMPT_TOKENS}-token prompt, {OUTPUTS[1]} tokens; batch 32 = {OUTPUTS[32]} tokens each; best of "
          f"{args.repeats}; a quiet machine is assumed", flush=True)
    llama = LLM(str(model_dir("llama")), dtype=args.dtype)
    try:
        alone = {batch: tokens_per_second(batch_run(llama, ROWS["llama"], batch, None), args.repeats)
                 for batch in OUTPUTS}
        print_row("llama", alone, alone)
        with tempfile.TemporaryDirectory() as tmp:
            for name in (name for name in args.rows if name != "llama"):
                turns = speeds_beside_llama(name, llama, args.dtype, args.repeats, Path(tmp))
                print_row(name, {batch: t["row"] for batch, t in turns.items()},
                          {batch: t["llama"] for batch, t in turns.items()}, turns[1].get("dense", 0.0))
        if args.compare_llamacpp:
            llamacpp_beside(llama, args.compare_llamacpp, args.gguf, args.repeats)
    finally:
        llama.shutdown()
    if args.int8_beyond_cache:
        int8_beyond_cache(args.dtype, args.repeats)


if __name__ == "__main__":
    main()
