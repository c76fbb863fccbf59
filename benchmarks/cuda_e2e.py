"""The CUDA path end to end on an 8B-shaped model (Llama-3-8B's shapes, random bf16 weights): one stage per run,
each in its own process so that every stage starts with the whole GPU. Results go to --results as JSON lines.

Stages (issue 26's figures):
    make        the model folder (config and tokenizer; weights are load_format="dummy"); --arch, --overrides: another
                family or shape (a mixture of experts: Qwen3-30B-A3B's shapes, below)
    batch1      batch-1 decode tok/s, CUDA graphs or --enforce-eager, against the bandwidth floor (the bytes of the
                weights a token reads, every linear layer (a mixture's router and top-k experts) and the LM head,
                over a measured device-to-device copy, read + write bytes per second): (T(out) - T(1)) / (out - 1),
                best of 3 each
    throughput  offline: N requests of random tokens, input/output lengths fixed, ignore_eos, output tok/s
    roofline    the throughput workload against its roofline (benchmarks/roofline.py): a prefill-only pass first,
                its MFU (of the measured bf16 matrix rate), then the run's time over its floor
    hf          the same requests (the first --num-requests) through HF transformers `generate` in padded
                batches, on a model of the same shapes and random weights, output tok/s
    overhead    engine overhead per decode step with N requests running: GPU idle time between kernels over the
                steps' span, from the torch profiler's kernel timeline

    python benchmarks/cuda_e2e.py make --model /tmp/llama3-8b
    python benchmarks/cuda_e2e.py batch1 --model /tmp/llama3-8b [--enforce-eager] [--quantization int8]
    python benchmarks/cuda_e2e.py throughput --model /tmp/llama3-8b --num-requests 1000
    python benchmarks/cuda_e2e.py roofline --model /tmp/llama3-8b --num-requests 1000
    python benchmarks/cuda_e2e.py hf --model /tmp/llama3-8b --num-requests 256
    python benchmarks/cuda_e2e.py overhead --model /tmp/llama3-8b --num-requests 256
    python benchmarks/cuda_e2e.py make --model /tmp/qwen3-30b-a3b --arch qwen3_moe --overrides "$QWEN3_30B_A3B"
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# The repository ahead of this folder, whose kernels.py would shadow the kernels package; this folder after it.
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cuda_trace import gpu_busy, print_kernel_table  # noqa: E402
from roofline import Shape, WorkloadFloors, copy_bandwidth, matmul_rate, synchronize  # noqa: E402

from ipc import EngineConfig, EngineCoreRequest, SamplingParams  # noqa: E402
from ipc.config import KV_CACHE_DTYPES  # noqa: E402
from launch.make_model import make_model, quiet_transformers  # noqa: E402

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

def random_prompts(args: argparse.Namespace, count: int) -> list[list[int]]:
    """Random ids the tokenizer knows (the 8b config's vocabulary is larger); id 0 is eos: never drawn."""
    from transformers import AutoConfig

    vocab = min(8000, AutoConfig.from_pretrained(args.model).vocab_size)
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(args.input_len)] for _ in range(count)]


def engine_args(args: argparse.Namespace, **extra) -> dict:
    return dict(dtype="bfloat16", load_format="dummy", device=args.device, enforce_eager=args.enforce_eager,
                decode_ahead=not args.no_decode_ahead, kv_cache_dtype=args.kv_cache_dtype,
                max_model_len=args.max_model_len, quantization=args.quantization, **extra)


def freeze_startup_objects() -> None:
    """As the engine-core process does once it is ready (core/engine_process.py): the model's and libraries'
    objects out of the cyclic collector's sight, so its full collections do not walk them mid-step."""
    gc.collect()
    gc.freeze()


def gemv_choices(runner: ModelRunner) -> list[dict]:
    """What start-up timing chose for the one-row products, per group of weights of one shape, dtype and bias
    presence (kernels.gemv_choice)."""
    return [dataclasses.asdict(choice) for choice in runner.gemv_choices]


def record(args: argparse.Namespace, result: dict) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = {"stage": args.stage, "device": device, "torch": torch.__version__,
              "triton": _triton_version(), "date": time.strftime("%Y-%m-%d"), **result}
    if args.stage in ("batch1", "throughput", "roofline", "overhead"):
        result["decode_ahead"] = not args.no_decode_ahead
        result["triton_gemv"] = args.triton_gemv
        result["kv_cache_dtype"] = args.kv_cache_dtype
        result["quantization"] = args.quantization
    print(json.dumps(result), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")


def _triton_version() -> str:
    import triton

    return triton.__version__


def stage_make(args: argparse.Namespace) -> None:
    print(make_model(args.model, args.arch, args.size, weights=False, **json.loads(args.overrides)))


def stage_batch1(args: argparse.Namespace) -> None:
    from frontend import LLM

    floor_s = Shape.of(args.model).weight_bytes(1 if args.quantization else 2) / copy_bandwidth(args.device)
    llm = LLM(args.model, in_process=True, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], **engine_args(args))
    freeze_startup_objects()
    prompt = [{"prompt_token_ids": random_prompts(args, 1)[0]}]

    def best_of_3(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            assert len(out[0].outputs[0].token_ids) == max_tokens
        return min(times)

    per_token = (best_of_3(args.output_len) - best_of_3(1)) / (args.output_len - 1)
    runner = llm.client.engine.executor.worker.model_runner
    hits, choices = runner.ahead_hits, gemv_choices(runner)
    llm.shutdown()
    record(args, {"cuda_graphs": not args.enforce_eager, "ahead_hits": hits, "decode_tok_s": 1 / per_token,
                  "floor_tok_s": 1 / floor_s, "fraction_of_floor": floor_s / per_token, "gemv_choices": choices})


def stage_throughput(args: argparse.Namespace) -> None:
    """throughput: the workload's output tok/s. roofline: first a prefill-only pass of N requests (max_tokens 1),
    for the prefill's share of the measured bf16 matrix rate (MFU), then the workload on N other prompts against
    its roofline; the decode's time is the run's less the prefill pass's."""
    from frontend import LLM

    roofline = args.stage == "roofline"
    ceilings = (matmul_rate(args.device), copy_bandwidth(args.device)) if roofline else None
    llm = LLM(args.model, in_process=True, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, **engine_args(args))
    freeze_startup_objects()
    count = args.num_requests
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args, 2 * count if roofline else count)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up

    def timed(batch: list[dict], max_tokens: int) -> float:
        start = time.perf_counter()
        outputs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
        seconds = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(batch) * max_tokens
        return seconds

    prefill_s = timed(prompts[:count], 1) if roofline else None
    run_s = timed(prompts[-count:], args.output_len)
    stats = llm.get_stats()
    llm.shutdown()
    result = {"requests": count, "input_len": args.input_len, "output_len": args.output_len,
              "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
              "cuda_graphs": not args.enforce_eager, "seconds": run_s, "output_tok_s": count * args.output_len / run_s,
              "total_tok_s": count * (args.output_len + args.input_len) / run_s, "preemptions": stats.num_preemptions}
    if roofline:
        flops_s, bytes_s = ceilings
        floors = WorkloadFloors.of(Shape.of(args.model), count, args.input_len, args.output_len, args.max_num_seqs)
        roofline_s = floors.prefill_s(flops_s) + floors.decode_s(flops_s, bytes_s)
        result |= {"matmul_tflop_s": flops_s / 1e12, "copy_tb_s": bytes_s / 1e12, "prefill_s": prefill_s,
                   "prefill_mfu": floors.prefill_s(flops_s) / prefill_s, "roofline_s": roofline_s,
                   "run_over_roofline": run_s / roofline_s, "decode_floor_s": floors.decode_s(flops_s, bytes_s),
                   "decode_share_of_floor": floors.decode_s(flops_s, bytes_s) / max(run_s - prefill_s, 1e-9),
                   **dataclasses.asdict(floors)}
    record(args, result)


def stage_hf(args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    config.initializer_range = 0.02  # the maker's 0.15 suits tiny models; 32 layers of it overflow bfloat16
    with quiet_transformers(), torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    prompts = random_prompts(args, args.num_requests)
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                  pad_token_id=0)

    def run(batch: list[list[int]]) -> int:
        ids = torch.tensor(batch, device=args.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return (out.shape[1] - ids.shape[1]) * len(batch)

    with torch.inference_mode():
        run(prompts[:2])  # warm-up
        synchronize(args.device)
        start = time.perf_counter()
        generated = sum(run(prompts[i:i + args.hf_batch_size]) for i in range(0, len(prompts), args.hf_batch_size))
        synchronize(args.device)
        seconds = time.perf_counter() - start
    record(args, {"requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                  "batch_size": args.hf_batch_size, "seconds": seconds, "output_tok_s": generated / seconds})


def stage_overhead(args: argparse.Namespace) -> None:
    from core import EngineCore

    engine = EngineCore(EngineConfig(model=args.model, max_num_seqs=args.num_requests,
                                     max_num_batched_tokens=args.max_num_batched_tokens, **engine_args(args)))
    freeze_startup_objects()
    for i, prompt in enumerate(random_prompts(args, args.num_requests)):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True)))
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # decode-only from here
        engine.step()
    assert len(engine.scheduler.running) == args.num_requests
    steps = args.profile_steps
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(args.device)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(steps):
            engine.step()
        synchronize(args.device)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    profile.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    busy, span, kernels = gpu_busy(events)
    print_kernel_table(events, steps)
    if args.host_profile:  # where the host's share of a step goes
        with cProfile.Profile() as host:
            for _ in range(steps):
                engine.step()
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
    runner = engine.executor.worker.model_runner
    hits, choices = runner.ahead_hits, gemv_choices(runner)
    engine.shutdown()
    record(args, {"running": args.num_requests, "context": args.input_len, "cuda_graphs": not args.enforce_eager,
                  "ahead_hits": hits,
                  "step_ms": step_ms, "profiled_steps": steps, "kernels": kernels, "gpu_busy_ms": busy / 1e3,
                  "span_ms": span / 1e3, "idle_fraction": 1 - busy / span if span else None,
                  "gemv_choices": choices})


STAGES = {"make": stage_make, "batch1": stage_batch1, "throughput": stage_throughput, "roofline": stage_throughput,
          "hf": stage_hf, "overhead": stage_overhead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--model", required=True, help="the model folder (stage make writes it)")
    parser.add_argument("--results", help="append each result here as a JSON line")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-decode-ahead", action="store_true", help="the engine's --no-decode-ahead")
    parser.add_argument("--triton-gemv", choices=["auto", "off", "always"], default="auto",
                        help="one-row products: timed choice of cuBLAS or the Triton GEMV, cuBLAS only, Triton only")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the engine's --kv-cache-dtype (the decode attention kernels alone with fp8 caches: "
                             "benchmarks/kernels.py --kv-cache-dtype)")
    parser.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                        help="online weight quantization at load (the floor counts a byte a layer weight)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of the stages")
    parser.add_argument("--size", default="8b", help="stage make: the model maker's size")
    parser.add_argument("--arch", default="llama", help="stage make: the model maker's family")
    parser.add_argument("--overrides", default="{}", help="stage make: config values as a JSON object")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=None, help="default: 64 (batch1), 1024 (throughput, hf), "
                                                                    "512 (overhead)")
    parser.add_argument("--output-len", type=int, default=None, help="default: 256 (batch1), 128 (throughput, hf), "
                                                                     "64 (overhead)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--host-profile", action="store_true", help="overhead: also print cProfile's top functions")
    args = parser.parse_args()
    args.input_len = args.input_len or {"batch1": 64, "overhead": 512}.get(args.stage, 1024)
    args.output_len = args.output_len or {"batch1": 256, "overhead": 64}.get(args.stage, 128)
    warnings.filterwarnings("ignore")
    from kernels.gemv_choice import MODE_ENV

    os.environ[MODE_ENV] = args.triton_gemv  # the engine runs in this process
    STAGES[args.stage](args)


if __name__ == "__main__":
    main()
