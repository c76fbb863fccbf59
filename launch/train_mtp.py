"""Train a small DeepSeek-V3-shaped model with its multi-token-prediction layer on the demo corpus (the shipped demo's
tokenizer), as DeepSeek trains them: the next-token loss plus MTP_WEIGHT x the MTP layer's loss on the token after.

    python -m launch.train_mtp --out DIR [--steps 200]   # benchmarks/spec_decode.py --method mtp trains its own
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

from kernels.cpu_features import cpu_has_native_bf16
from launch.demo_corpus import split, stdlib_files
from launch.demo_tokens import batch_at, token_stream, training_documents
from launch.make_model import benchmark_cache_dir
from launch.model_shapes import ENDOFTEXT_ID, ROPE_PARAMETERS
from launch.mtp_layer import HfMtpLayer, random_mtp_layer
from launch.shipped import WEIGHTS_DIR
from launch.train_demo import HELD_OUT_FRACTION

MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda early in its training
RECIPE = {"steps": 200, "batch": 8, "context": 128, "lr": 2e-3, "warmup": 20, "seed": 0}


def model_config(vocab_size: int) -> DeepseekV3Config:
    """Hidden 128 over 3 layers (the first dense), MLA, 8 routed experts (2 per token in the best 2 of 4 groups)."""
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32, max_position_embeddings=512, rope_parameters=dict(ROPE_PARAMETERS),
        num_nextn_predict_layers=1, tie_word_embeddings=False, initializer_range=0.02, bos_token_id=ENDOFTEXT_ID,
        eos_token_id=ENDOFTEXT_ID, pad_token_id=ENDOFTEXT_ID, dtype="float32")


def losses(target: DeepseekV3ForCausalLM, mtp: HfMtpLayer, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss): row p of the MTP layer takes h_p and token p + 1 and predicts token p + 2."""
    hidden = target.model(input_ids=windows[:, :-1]).last_hidden_state
    main = F.cross_entropy(target.lm_head(hidden).float().flatten(0, 1), windows[:, 1:].flatten())
    out = mtp(windows[:, 1:-1], hidden[:, :-1])
    return main, F.cross_entropy(mtp.logits(out).float().flatten(0, 1), windows[:, 2:].flatten())


def train(out: Path, steps: int, log_every: int = 25, max_files: int | None = None) -> dict:
    """Train RECIPE (with `steps`; on the first max_files stdlib files for a smoke run) and export the model, its MTP
    layer and the demo's tokenizer to `out`."""
    torch.manual_seed(RECIPE["seed"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(WEIGHTS_DIR / "demo"))
    # the demo's held-out files stay out: the benchmark drafts on them
    train_files, _ = split(stdlib_files(max_files), HELD_OUT_FRACTION, RECIPE["seed"])
    stream = token_stream(tokenizer.backend_tokenizer, training_documents(train_files))
    config = model_config(len(tokenizer))
    target, mtp = DeepseekV3ForCausalLM(config).float().train(), random_mtp_layer(config, RECIPE["seed"]).train()
    params = list(target.parameters()) + list(mtp.parameters())
    optimizer = torch.optim.AdamW(params, lr=RECIPE["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    autocast, log, start = cpu_has_native_bf16(), [], time.perf_counter()
    for step in range(steps):
        warm = RECIPE["warmup"]
        scale = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        for group in optimizer.param_groups:
            group["lr"] = RECIPE["lr"] * scale
        windows = batch_at(stream, step, RECIPE["batch"], RECIPE["context"], RECIPE["seed"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            main, extra = losses(target, mtp, windows)
        optimizer.zero_grad(set_to_none=True)
        (main + MTP_WEIGHT * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log.append({"step": step + 1, "minutes": round((time.perf_counter() - start) / 60, 2),
                        "loss": round(main.item(), 4), "mtp_loss": round(extra.item(), 4)})
            print(json.dumps(log[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    target.to(torch.bfloat16).save_pretrained(out)
    mtp.to(torch.bfloat16).save_into(out)
    tokenizer.save_pretrained(out)
    shutil.copy(WEIGHTS_DIR / "demo" / "generation_config.json", out / "generation_config.json")
    record = {"recipe": {**RECIPE, "steps": steps}, "seed": RECIPE["seed"], "mtp_weight": MTP_WEIGHT, "log": log}
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    return record


def ensure_mtp_model(steps: int = RECIPE["steps"]) -> Path:
    """The trained model in the benchmark cache, trained there first if it is not (or with another step count)."""
    out = benchmark_cache_dir() / f"mtp-demo-{steps}"
    if not (out / "training_log.json").exists():
        train(out, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train_mtp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=RECIPE["steps"])
    args = parser.parse_args(argv)
    train(args.out, args.steps)
    print(f"exported {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
