"""int8 weight-only quantization: the kernels equal a dequantized reference, and a quantized engine equals HF
transformers running the same model with the dequantized weights."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from conftest import random_prompts, tiny_model
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from kernels import cpu_gemv
from kernels.matmul import linear
from workers.quantization.online import quantize_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def test_rows_round_to_the_nearest_step_of_their_own_scale():
    weight = torch.randn(33, 70) * torch.rand(33, 1) * 3
    weight[5] = 0.0  # an all-zero row keeps scale 1, not 0/0
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() == 127
    assert scale[5] == 1.0 and not q[5].any()
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-6).all()


def test_fp8_rows_keep_three_mantissa_bits_of_their_own_scale():
    weight = torch.randn(33, 70) * torch.rand(33, 1) * 3
    q, scale = quantize_rows(weight, dtype=torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and (q.float().abs().amax(1) == 448).all()
    # e4m3 rounds to 3 mantissa bits (relative error <= 1/16) down to its smallest normal, 2^-6, times the scale.
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= weight.abs() / 16 + 2**-9 * scale[:, None]).all()


@pytest.mark.parametrize("rows", [1, 3, 40, 64, 65])  # GEMV up to 64 rows, the dequantizing GEMM past them
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()  # as the engine runs (the GEMV kernel serves no autograd)
def test_int8_linear_equals_the_dequantized_weight(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(75, 131, generator=generator))  # K not a multiple of 8 or 32
    x = torch.randn(rows, 131, generator=generator).to(dtype)
    bias = torch.randn(75, generator=generator).to(dtype)
    assert cpu_gemv.serves(x, q, bias) == (rows <= cpu_gemv.INT8_MAX_ROWS)
    expected = torch.nn.functional.linear(x.float(), q.float() * scale[:, None], bias.float())
    got = linear(x, q, bias, scale)
    assert got.dtype == dtype
    tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), expected, **tolerance)


@functools.cache
def dequantized_copy(model: str, quantize_lm_head: bool, method: str = "int8") -> str:
    """The model folder with every weight the engine quantizes replaced by its dequantized value (float32)."""
    from transformers import AutoModelForCausalLM

    folder = Path(model).parent / f"{Path(model).name}-{method}-dequantized{'-head' if quantize_lm_head else ''}"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and (quantize_lm_head or name != "lm_head"):
                q, scale = quantize_rows(module.weight, dtype=STORAGE[method])
                module.weight.copy_(q.float() * scale[:, None])
    hf.save_pretrained(folder)
    for file in Path(model).glob("tokenizer*"):
        (folder / file.name).write_bytes(file.read_bytes())
    return str(folder)


@pytest.mark.parametrize("arch, quantize_lm_head, method", [("llama", False, "int8"), ("qwen2", True, "int8"),
                                                            ("mixtral", False, "int8"), ("llama", False, "fp8"),
                                                            ("qwen2", True, "fp8")])
def test_online_quantized_engine_equals_hf_on_dequantized_weights(arch, quantize_lm_head, method):
    """qwen2 ties its embeddings to the head: quantizing the head quantizes the table the embeddings read too.
    Mixtral: the attention and any dense layers are quantized; the router and the experts stay as loaded. fp8 on
    a CPU is weight-only (tiles dequantized per product)."""
    model = tiny_model(arch)
    reference = dequantized_copy(model, quantize_lm_head, method)
    prompts = random_prompts([3, 40, 150], vocab=1000)
    llm = LLM(model, dtype="float32", quantization=method, quantize_lm_head=quantize_lm_head)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(reference, prompt, 16), f"{len(prompt)}-token prompt"
    finally:
        llm.shutdown()


def test_weight_bytes_shrink_and_are_reported():
    """On the demo model (tied embeddings, rows of 192 and more: the float32 scales add 2% or less)."""
    from launch.shipped import WEIGHTS_DIR

    model = str(WEIGHTS_DIR / "demo")
    sizes = {}
    for quantization, head in ((None, False), ("int8", False), ("int8", True)):
        llm = LLM(model, dtype="bfloat16", in_process=True, quantization=quantization, quantize_lm_head=head)
        sizes[quantization, head] = llm.info.weight_bytes
        llm.shutdown()
    full = sizes[None, False]
    assert sizes["int8", False] < full
    # Tied embeddings: quantizing the head halves the table too; norms and scales keep it a little above half.
    assert 0.5 * full < sizes["int8", True] <= 0.55 * full


def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; supported: int8"):
        LLM(tiny_model("llama"), dtype="float32", in_process=True, quantization="int4")


def test_a_plain_checkpoint_claiming_a_quantized_format_is_refused_at_load(tmp_path):
    import json

    source = Path(tiny_model("llama"))
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names gptq, but none of its tensors is stored that way"):
        LLM(str(tmp_path), dtype="float32", in_process=True)
