"""AutoRound checkpoints written by the auto-round package: the engine equals HF transformers on the weights
auto-round's own code dequantizes (greedy tokens and their logprobs, float32) and, where transformers loads the
folder itself, its greedy tokens; unsupported settings are refused by name at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autoround_checkpoints import AUTOROUND_SPECS, hf_autoround_model
from conftest import autoround_model, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from checkpoint_checks import assert_equals_reference, copy_folder, edit_quantization_config, load_error


@pytest.mark.parametrize("kind", list(AUTOROUND_SPECS))
def test_autoround_checkpoint_equals_autorounds_dequantization(kind):
    assert_equals_reference(*autoround_model(kind))


@pytest.mark.parametrize("kind", ["w4-sym-mixed", "w4-asym-gptqmodel"])
@torch.inference_mode()
def test_greedy_equals_hf_transformers_on_the_same_folder(kind):
    """Where HF transformers loads the folder on a CPU (auto-round's torch QuantLinear; not its AWQ packing)."""
    quantized = autoround_model(kind)[0]
    prompt = random_prompts([30], vocab=1000)[0]
    llm = LLM(quantized, dtype="float32", in_process=True)
    try:
        ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    input_ids = torch.tensor([prompt])
    hf = hf_autoround_model(quantized).generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                                max_new_tokens=12, do_sample=False, min_new_tokens=0,
                                                eos_token_id=None, pad_token_id=0)
    assert ours[0].outputs[0].token_ids == hf[0, len(prompt):].tolist()


def test_the_packings_and_overrides_are_the_ones_autoround_wrote():
    """The cases above cover what they claim: auto-round's two default packings, the override of one layer to 8
    bits and of another to 16 (stored plain), and GPTQModel's `dynamic` in the GPTQ folder it writes."""
    configs = {kind: json.loads((Path(autoround_model(kind)[0]) / "config.json").read_text())["quantization_config"]
               for kind in ("w4-sym-mixed", "w4-asym", "gptq-export-mixed")}
    assert configs["w4-sym-mixed"]["packing_format"] == "auto_round:auto_gptq"
    assert configs["w4-sym-mixed"]["extra_config"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert configs["w4-asym"]["packing_format"] == "auto_round:auto_awq"
    assert configs["gptq-export-mixed"]["quant_method"] == "gptq"
    assert any(key.startswith("-:") for key in configs["gptq-export-mixed"]["dynamic"])


def _edited(tmp_path: Path, edit) -> Path:
    folder = copy_folder(autoround_model("w4-sym-mixed")[0], tmp_path / "m")
    edit_quantization_config(folder, edit)
    return folder


@pytest.mark.parametrize("edit", [lambda c: c.pop("packing_format"),
                                  lambda c: c.update(packing_format="auto_round:gptq")])
def test_older_packing_names_read_as_autorounds_loader_reads_them(tmp_path, edit):
    """No packing_format (transformers' default "auto_round:gptq") and that older name: the auto_gptq packing."""
    assert_equals_reference(str(_edited(tmp_path, edit)), autoround_model("w4-sym-mixed")[1])


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(packing_format="auto_round:llm_compressor"),
     "packing_format 'auto_round:llm_compressor' is not supported; supported: auto_round:auto_gptq"),
    (lambda c: c.update(data_type="mx_fp"), "data_type 'mx_fp' is not supported (int)"),
    (lambda c: c.update(act_bits=8), "act_bits 8 (quantized activations) is not supported"),
    (lambda c: c.update(bits=2),
     "quantization_config (auto_round:auto_gptq): 2-bit weights are not supported (4 or 8)"),
    (lambda c: c.update(packing_format="auto_round:auto_awq"),
     "extra_config 'model.layers.0.mlp.down_proj' (auto_round:auto_awq): 8-bit weights are not supported (4)"),
    (lambda c: c["extra_config"]["model.layers.0.mlp.down_proj"].update(bits=3),
     "extra_config 'model.layers.0.mlp.down_proj' (auto_round:auto_gptq): 3-bit weights are not supported"),
    (lambda c: c["extra_config"].update({"model.layers.0.mlp.up_proj": {"bits": 16}}),
     "'model.layers.0.mlp.up_proj' is stored quantized, but extra_config leaves it at 16 bits"),
    (lambda c: c["extra_config"].update({".*gate_proj.*": {"bits": 8}}), "does not fit scales")])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, message):
    assert message in load_error(_edited(tmp_path, edit))


def test_quantization_auto_round_must_match_the_checkpoint():
    assert "already quantized (auto-round)" in load_error(autoround_model("w4-asym")[0], quantization="gptq")
    assert "has no quantization_config" in load_error(tiny_model("llama"), quantization="auto-round")
