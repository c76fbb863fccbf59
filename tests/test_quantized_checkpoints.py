"""Quantized checkpoints (compressed-tensors, GPTQ, AWQ): the engine on the quantized folder equals HF transformers
on the weights the reference dequantizes (greedy tokens and their logprobs, float32); malformed checkpoints are
clear errors at load."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from frontend import LLM
from kernels.matmul import linear
from kernels.quantized_matmul import dequantize, linear_reference, pack_int4, unpack_int4
from checkpoint_checks import assert_equals_reference, copy_folder, edit_quantization_config, load_error
from quantized_checkpoints import CHECKPOINTS, checkpoint

@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_quantized_checkpoint_equals_its_dequantized_reference(kind):
    assert_equals_reference(*checkpoint(kind))


@pytest.mark.parametrize("kind", ["gptq-4bit-act-order", "ct-w4a16-asymmetric"])
def test_biases_and_tied_embeddings_load_beside_quantized_weights(kind):
    """qwen2: q/k/v biases next to packed weights, the head tied to the embeddings (left unquantized)."""
    assert_equals_reference(*checkpoint(kind, "qwen2"))


def test_weights_stay_packed_in_memory():
    plain = LLM(tiny_model("llama"), dtype="float32", in_process=True)
    sizes = {}
    for kind in ("ct-w4a16", "ct-w8a16"):
        llm = LLM(checkpoint(kind)[0], dtype="float32", in_process=True)
        sizes[kind] = llm.info.weight_bytes
        llm.shutdown()
    full = plain.info.weight_bytes
    plain.shutdown()
    assert sizes["ct-w4a16"] < sizes["ct-w8a16"] < full


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_quantized_linear_paths_equal_the_dequantized_weight(rows, dtype):
    """Every storage the kernels take (grouped int8 through the GEMV kernel, packed 4-bit with zero points and
    act-order, fp8), a few rows and many, against the whole weight dequantized in float32."""
    generator = torch.Generator().manual_seed(rows)
    n, k, groups = 48, 128, 4
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    scale = torch.rand(n, groups, generator=generator) / 50
    int8 = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    values = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    zero = torch.randint(0, 16, (n, groups), generator=generator).float()
    g_idx = (torch.randperm(k, generator=generator) % groups).to(torch.int32)
    fp8 = (torch.randn(n, k, generator=generator) * 10).to(torch.float8_e4m3fn)
    cases = [(int8, scale, None, None), (int8, scale[:, 0].contiguous(), None, None),
             (pack_int4(values), scale, zero, g_idx), (pack_int4(values), scale, None, None),
             (fp8, scale[:, 0].contiguous(), None, None)]
    for weight, s, z, g in cases:
        expected = linear_reference(x, weight, s, z, g, bias)
        got = linear(x, weight, bias, s, z, g)
        assert got.dtype == dtype
        tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.15, "rtol": 2e-2}
        torch.testing.assert_close(got.float(), expected, **tolerance)


def test_int4_packing_round_trips_and_dequantizes_by_group():
    values = torch.randint(0, 16, (6, 16), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)
    scale = torch.tensor([[1.0, 2.0]]).repeat(6, 1)
    weight = dequantize(pack_int4(values), scale)  # symmetric 4-bit: centred at 8
    assert torch.equal(weight[:, :8], values[:, :8].float() - 8) and torch.equal(weight[:, 8:], 2 * (values[:, 8:] - 8.0))


def _drop_tensor(folder: Path, suffix: str) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith(suffix))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_quant_method_is_a_clear_error(tmp_path):
    folder = copy_folder(checkpoint("gptq-4bit")[0], tmp_path / "m")
    edit_quantization_config(folder, lambda c: c.update(quant_method="bitsandbytes"))
    assert "quant_method 'bitsandbytes' is not supported" in load_error(folder)


@pytest.mark.parametrize("kind, edit", [("gptq-4bit", lambda c: c.update(group_size=32)),
                                        ("awq", lambda c: c.update(group_size=64)),
                                        ("ct-w4a16", lambda c: c["config_groups"]["group_0"]["weights"].update(
                                            group_size=64))])
def test_mismatched_group_size_is_a_clear_error(tmp_path, kind, edit):
    folder = copy_folder(checkpoint(kind)[0], tmp_path / "m")
    edit_quantization_config(folder, edit)
    assert "does not fit" in load_error(folder)


@pytest.mark.parametrize("kind, tensor, message", [
    ("ct-w4a16", ".weight_scale", "no weight_scale"),
    ("ct-int8-tensor", ".weight_scale", "no quantization scales"),  # the int8 weight alone: never read as floats
    ("ct-w4a16-asymmetric", ".weight_zero_point", "no weight_zero_point"),
    ("gptq-4bit", ".scales", "no scales"),
    ("gptq-4bit-act-order", ".g_idx", "no g_idx"),
    ("awq", ".qzeros", "no qzeros")])
def test_missing_scales_zero_points_or_g_idx_are_clear_errors(tmp_path, kind, tensor, message):
    folder = copy_folder(checkpoint(kind)[0], tmp_path / "m")
    _drop_tensor(folder, tensor)
    assert message in load_error(folder)


def test_a_quantization_that_contradicts_the_checkpoint_is_refused():
    assert "already quantized (gptq)" in load_error(checkpoint("gptq-4bit")[0], quantization="int8")
    assert "already quantized (gptq)" in load_error(checkpoint("gptq-4bit")[0], quantization="awq")
    assert "has no quantization_config" in load_error(tiny_model("llama"), quantization="gptq")
