"""FP8 block-quantized checkpoints (issue 56, DeepSeek-V3's weights): greedy tokens and logprobs equal a float32
reference holding the same blocks dequantized, on llama and DeepSeek-V3 (MLA projections, experts), with blocks
that do not divide the weights' dimensions; other fp8 layouts are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_checks import assert_equals_reference, copy_folder, edit_quantization_config, load_error
from conftest import _MODEL_ROOT, assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from kernels import cpu_decoder_layer, cpu_gemv
from quantized_checkpoints import fp8_block_checkpoint
from workers.fast_path.later_step_calls import LaterStepCalls

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


def test_fp8_blocks_take_the_fused_path_and_equal_the_torch_path(monkeypatch):
    """Blocks whose columns divide the weights' (24 x 16: the scales as groups of 16 along K): every layer runs in
    the C++ layer reading the fp8 bytes, the later steps of each multi-step call in one C++ call (greedy_decode);
    greedy tokens equal the dequantized reference's (HF float32) and the torch path's (tiles dequantized op by op)."""
    quantized, reference = fp8_block_checkpoint(tiny_model("llama"), _MODEL_ROOT / "llama-tiny-fp8-blocks-24x16",
                                                 (24, 16))
    prompts = random_prompts([3, 40, 17], vocab=1000, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    layer_calls, one_calls = [], []
    layers, in_one_call = cpu_decoder_layer.decoder_layers, LaterStepCalls._in_one_call
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *a, **kw: layer_calls.append(1) or layers(*a, **kw))
    monkeypatch.setattr(LaterStepCalls, "_in_one_call", lambda *a: one_calls.append(in_one_call(*a)) or one_calls[-1])

    def generate() -> list[list[int]]:
        llm = LLM(quantized, dtype="float32", in_process=True, block_size=8, num_scheduler_steps=8,
                  multi_step_budget_ms=None)
        try:
            model = llm.client.engine.executor.worker.model_runner.model
            assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert_all_blocks_free(llm)
            return [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()

    fused = generate()
    assert layer_calls and any(one_calls), "the fp8 model never took the C++ layer and its one-call steps"
    assert fused == [hf_greedy(reference, p, params.max_tokens) for p in prompts]
    monkeypatch.setattr(cpu_decoder_layer, "decode_step", lambda *args: None)
    monkeypatch.setattr(LaterStepCalls, "_in_one_call", lambda *args: False)
    assert generate() == fused


def test_deepseek_v3_linear_layers_read_fp8_blocks_in_the_kernel(monkeypatch):
    """DeepSeek-V3 (MLA and experts outside the C++ layer): its fp8 Linear layers' few-row products are the C++
    kernel's (cpu_gemv.gemv_quantized), not tiles dequantized in torch, and the logits stay the reference's."""
    quantized, reference = fp8_block_checkpoint(tiny_model("deepseek_v3"),
                                                _MODEL_ROOT / "deepseek_v3-tiny-fp8-blocks-24x16", (24, 16))
    calls = []
    kernel = cpu_gemv.gemv_quantized
    monkeypatch.setattr(cpu_gemv, "gemv_quantized", lambda *args: calls.append(args[1].dtype) or kernel(*args))
    assert_equals_reference(quantized, reference)
    assert torch.float8_e4m3fn in calls


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
