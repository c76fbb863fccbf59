"""A plain checkpoint written as DeepSeek-V3's FP8 block-quantized weights (quant_method fp8, weight_block_size, a
weight_scale_inv per block), and the float32 folder holding the same blocks dequantized: for the format's tests and
its speed row in benchmarks/feature_speed.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
                   "kv_a_proj_with_mqa", "kv_b_proj")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_block_checkpoint(source: str, folder: Path, block: tuple[int, int], with_reference: bool = True
                         ) -> tuple[str, str | None]:
    """An fp8 checkpoint with one weight_scale_inv per `block` of every projection (DeepSeek-V3's layout: absmax
    / 448 a block, as its conversion writes), made from the safetensors as stored, and its float32 reference holding
    q * scale (folder/quantized, folder/reference). The router (mlp.gate), embeddings, norms and the LM head stay
    plain, as in DeepSeek's checkpoints."""
    tensors = load_file(str(Path(source) / "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(tuple(f"{p}.weight" for p in FP8_PROJECTIONS)) or tensor.dim() != 2:
            quantized[name] = reference[name] = tensor.float()
            continue
        rows, columns = tensor.shape
        padded = torch.zeros(-(-rows // block[0]) * block[0], -(-columns // block[1]) * block[1])
        padded[:rows, :columns] = tensor.float()
        blocks = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        dequantized = (q.float() * scale[:, None, :, None]).reshape(padded.shape)[:rows, :columns]
        quantized[name] = q.reshape(padded.shape)[:rows, :columns].contiguous()
        quantized[name.removesuffix("weight") + "weight_scale_inv"] = scale
        reference[name] = dequantized.contiguous()
    config = json.loads((Path(source) / "config.json").read_text())
    out = {}
    for kind, state, quant in (("quantized", quantized, {"quant_method": "fp8", "fmt": "e4m3",
                                                         "activation_scheme": "dynamic",
                                                         "weight_block_size": list(block)}),
                               ("reference", reference, None))[:2 if with_reference else 1]:
        target = folder / kind
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps(config | ({"quantization_config": quant} if quant else {})))
        for file in Path(source).glob("tokenizer*"):
            shutil.copy(file, target / file.name)
        out[kind] = str(target)
    return out["quantized"], out.get("reference")
