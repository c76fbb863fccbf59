"""Multi-LoRA throughput against the base model, the same requests through each engine, taking turns.

The model maker's ~30M llama, --requests requests at once (--prompt-tokens random prompt tokens, --output-tokens
output tokens, ignore_eos, bf16), offline LLM.generate, the median of --rounds (each round in another order: this
VM's run-to-run spread is larger than the differences measured, so no single best run decides) for each of:
- base: enable_lora off;
- enabled, unused: enable_lora on, no request names an adapter;
- one adapter: every request runs one rank-16 adapter on all seven projections;
- 8 adapters: 8 such adapters round-robin over the requests (max_loras 8).
Targets (issue 21): one adapter / base >= 0.85x; enabled-unused / base >= 0.97x; 8 adapters / one >= 0.9x.
--device picks where the engines run ("auto": CUDA when torch sees a GPU).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_device  # noqa: E402
from frontend import LLM, LoRARequest, SamplingParams  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402
from workers.model_config import load_hf_config  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model: str, rank: int, seed: int) -> str:
    """A PEFT-format adapter on every projection of `model` (random A and B), written without PEFT."""
    config = load_hf_config(model)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, config.num_attention_heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (config.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (inputs, outputs) in shapes.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return str(folder)


def throughput(llm: LLM, prompts: list[dict], params: SamplingParams, adapters: list[LoRARequest | None]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    device = bench_device.resolve(args.device)
    print(bench_device.describe(device))
    model = str(ensure_benchmark_model())
    vocab = load_hf_config(model).vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter{i}", i + 1, write_adapter(Path(tmp) / f"a{i}", model, args.rank, i))
                    for i in range(8)]
        common = {"dtype": "bfloat16", **bench_device.engine_args(device)}
        lora_args = {"enable_lora": True, "max_lora_rank": args.rank, **common}
        engines = {"base": LLM(model, **common),
                   "enabled, unused": LLM(model, **lora_args),
                   "one adapter": LLM(model, **lora_args),
                   "8 adapters": LLM(model, max_loras=8, **lora_args)}
        uses = {"base": [None] * len(prompts), "enabled, unused": [None] * len(prompts),
                "one adapter": [adapters[0]] * len(prompts),
                "8 adapters": [adapters[i % 8] for i in range(len(prompts))]}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        try:
            for name, llm in engines.items():  # warm-up: kernels, allocations, adapters loaded
                throughput(llm, prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), uses[name][:8])
            names = list(engines)
            for round_index in range(args.rounds):  # each round starts with another engine: no place is favoured
                for name in names[round_index % len(names):] + names[:round_index % len(names)]:
                    rates[name].append(throughput(engines[name], prompts, params, uses[name]))
        finally:
            for llm in engines.values():
                llm.shutdown()
    best = {name: statistics.median(values) for name, values in rates.items()}
    ratios = {"one adapter / base": best["one adapter"] / best["base"],
              "enabled, unused / base": best["enabled, unused"] / best["base"],
              "8 adapters / one adapter": best["8 adapters"] / best["one adapter"]}
    targets = {"one adapter / base": 0.85, "enabled, unused / base": 0.97, "8 adapters / one adapter": 0.9}
    for name, rate in best.items():
        print(f"{name}: {rate:.1f} output tok/s (median; rounds: {', '.join(f'{r:.0f}' for r in rates[name])})")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x (target >= {targets[name]}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "tokens_per_s": best, "rounds": rates,
                                               "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
