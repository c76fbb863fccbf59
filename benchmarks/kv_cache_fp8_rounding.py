"""Where fp8 KV's top-1 disagreements come from (issue 57): the demo model in HF transformers with K and V rounded
through kernels.kv_quant.stored_as after rotary, over its held-out text, teacher forced.

Prints each layer's |K| and |V| (largest, median, share under e4m3's smallest normal 2^-6), then top-1 agreement and
perplexity against bf16 KV for: the float32 model (the model's own rounding floor), e4m3 and e5m2 with scale 1.0 and
with scales calibrated to each layer's amax / the format's max (vLLM's calculate_kv_scales), K or V alone; then the
logit change fp8 causes against the float32 model's, and the agreement where bf16's top-1 leads by a margin.
    python benchmarks/kv_cache_fp8_rounding.py [--windows 64]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_perplexity import held_out_tokens  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from kernels import kv_quant  # noqa: E402
from launch.shipped import WEIGHTS_DIR  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# What the attention below does to K and V: {"k"/"v": (fp8 dtype, per-layer scales or None for 1.0)}.
ROUNDING: dict[str, tuple[torch.dtype, list[float] | None]] = {}
AMAX: dict[int, list[torch.Tensor]] = {}  # layer → |K| and |V| of the last plain bf16 run


def rounded_attention(module, query, key, value, mask, **kwargs):
    layer = module.layer_idx
    if not ROUNDING:
        AMAX.setdefault(layer, []).append(torch.stack([key.float().abs().flatten(), value.float().abs().flatten()]))
    for name in ROUNDING:
        dtype, scales = ROUNDING[name]
        scale = scales[layer] if scales else 1.0
        if name == "k":
            key = kv_quant.stored_as(key, scale, dtype)
        else:
            value = kv_quant.stored_as(value, scale, dtype)
    return eager_attention_forward(module, query, key, value, mask, **kwargs)


AttentionInterface.register("kv_rounding", rounded_attention)
AttentionMaskInterface.register("kv_rounding", AttentionMaskInterface._global_mapping["eager"])


@torch.no_grad()
def logits_and_nll(model, windows: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(windows).logits.float()[:, :-1]
    return logits, -logits.log_softmax(-1).gather(-1, windows[:, 1:, None]).sum().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows to score (at most)")
    args = parser.parse_args()
    path = WEIGHTS_DIR / "demo"
    windows = held_out_tokens(path, args.windows)
    models = {dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="kv_rounding").eval()
              for dtype in (torch.float32, torch.bfloat16)}
    count = windows.shape[0] * (windows.shape[1] - 1)
    f32, _ = logits_and_nll(models[torch.float32], windows)
    AMAX.clear()
    bf16, bf16_nll = logits_and_nll(models[torch.bfloat16], windows)
    amax = []
    for layer, parts in sorted(AMAX.items()):
        k, v = torch.cat(parts, 1)
        amax.append((k.max().item(), v.max().item()))
        print(f"layer {layer}: " + "; ".join(f"|{n}| max {x.max():.2f} median {x.median():.3f}, under 2^-6 "
                                             f"{(x < 2 ** -6).float().mean():.1%}" for n, x in (("K", k), ("V", v))))
    print(f"{count} held-out positions; bf16 KV perplexity {math.exp(bf16_nll / count):.3f}")

    def against_bf16(name: str, logits: torch.Tensor, nll: float | None = None) -> None:
        agreement = (logits.argmax(-1) == bf16.argmax(-1)).float().mean().item()
        change = "" if nll is None else f", perplexity {math.exp(nll / count) / math.exp(bf16_nll / count) - 1:+.2%}"
        print(f"  {name}: top-1 agreement with bf16 KV {agreement:.2%}{change}")

    against_bf16("float32 model", f32)
    variants = {}
    for dtype, label in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        most = torch.finfo(dtype).max
        calibrated = {"k": [k / most for k, _ in amax], "v": [v / most for _, v in amax]}
        variants[f"{label} scale 1.0"] = {"k": (dtype, None), "v": (dtype, None)}
        variants[f"{label} calibrated amax / {most:g}"] = {n: (dtype, calibrated[n]) for n in ("k", "v")}
    variants["e4m3 K alone"], variants["e4m3 V alone"] = {"k": (E4M3, None)}, {"v": (E4M3, None)}
    for name, rounding in variants.items():
        ROUNDING.update(rounding)
        against_bf16(name, *logits_and_nll(models[torch.bfloat16], windows))
        ROUNDING.clear()
    ROUNDING.update(variants["e4m3 scale 1.0"])
    e4m3, _ = logits_and_nll(models[torch.bfloat16], windows)
    ROUNDING.clear()
    top2 = bf16.topk(2, -1).values
    margin = (top2[..., 0] - top2[..., 1]).flatten()
    moved, own = (e4m3 - bf16).abs().amax(-1), (f32 - bf16).abs().amax(-1)
    print(f"largest logit change per position, median: e4m3 KV {moved.median():.4f}, float32 model {own.median():.4f}")
    ties, close = (margin == 0).float().mean(), (margin < 0.1).float().mean()
    print(f"bf16's top two: exact ties {ties:.2%}, within 0.1 {close:.2%}")
    differs = (bf16.argmax(-1) != e4m3.argmax(-1)).flatten()
    print(f"bf16's lead where e4m3 disagrees, median: {margin[differs].median():.4f}")
    for least in (0.1, 0.2, 0.3):
        kept = margin >= least
        print(f"  where bf16's top-1 leads by >= {least} ({kept.float().mean():.1%} of positions): e4m3 agrees on "
              f"{1 - differs[kept].float().mean():.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
