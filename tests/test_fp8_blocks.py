"""FP8 block-quantized checkpoints (issue 56, DeepSeek-V3's weights): greedy tokens and logprobs equal a float32
reference holding the same blocks dequantized, on llama and DeepSeek-V3 (MLA projections, experts), with blocks
that do not divide the weights' dimensions; other fp8 layouts are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_checks import assert_equals_reference, copy_folder, edit_quantization_config, load_error
from conftest import _MODEL_ROOT, tiny_model
from quantized_checkpoints import fp8_block_checkpoint

# Neither divides the tiny models' widths (64, 176, ...): every weight has narrower last blocks.
BLOCK = (24, 40)


def checkpoint(arch: str) -> tuple[str, str]:
    return fp8_block_checkpoint(tiny_model(arch), _MODEL_ROOT / f"{arch}-tiny-fp8-blocks", BLOCK)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_fp8_blocks_equal_their_dequantized_reference(arch):
    quantized, reference = checkpoint(arch)
    stored = load_file(f"{quantized}/model.safetensors")
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert_equals_reference(quantized, reference)


def test_other_fp8_layouts_are_refused_by_name(tmp_path):
    quantized, _ = checkpoint("llama")
    per_tensor = copy_folder(quantized, tmp_path / "per-tensor")
    edit_quantization_config(per_tensor, lambda q: q.pop("weight_block_size"))
    assert "weight_block_size" in load_error(per_tensor)
    static = copy_folder(quantized, tmp_path / "static")
    edit_quantization_config(static, lambda q: q.update(activation_scheme="static"))
    assert "activation_scheme 'static'" in load_error(static)
    other_blocks = copy_folder(quantized, tmp_path / "blocks")
    edit_quantization_config(other_blocks, lambda q: q.update(weight_block_size=[32, 32]))
    assert "does not give one scale per 32x32 block" in load_error(other_blocks)
    config = json.loads((tmp_path / "blocks" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
