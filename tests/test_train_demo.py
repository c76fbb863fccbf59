"""The demo model's training script: a short seeded run learns, resumes from its checkpoint exactly, and exports a
model folder the engine and HF transformers load; the skills stage fine-tunes an export."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from launch import train_demo
from launch.shipped import shipped_model

SMOKE = ["--model", "draft", "--steps", "12", "--max-files", "150", "--eval-every", "6", "--no-compile"]


def test_a_short_run_learns_resumes_exactly_and_exports(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_demo.main([*SMOKE, "--checkpoint-dir", str(tmp_path / "a"), "--out", str(straight)]) == 0
    assert train_demo.main([*SMOKE, "--checkpoint-dir", str(tmp_path / "b"), "--stop-at-step", "6"]) == 0
    assert not resumed.exists()
    assert train_demo.main([*SMOKE, "--checkpoint-dir", str(tmp_path / "b"), "--out", str(resumed)]) == 0

    log = json.loads((straight / "training_log.json").read_text())["log"]
    assert [entry["step"] for entry in log] == [6, 12]
    # it learned something: below a uniform guess over the vocabulary, and lower at the end than halfway
    assert log[-1]["held_out_loss"] < log[0]["held_out_loss"] < math.log(train_demo.TOKENIZER_VOCAB) - 0.3
    weights, again = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())

    tokenizer = AutoTokenizer.from_pretrained(straight)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((straight / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_the_skills_stage_fine_tunes_an_export_and_keeps_its_pretraining_log(tmp_path, monkeypatch):
    base, out = shipped_model("demo"), tmp_path / "out"
    monkeypatch.setitem(train_demo.RECIPES, "demo-skills", replace(train_demo.RECIPES["demo-skills"], skills=60))
    with pytest.raises(SystemExit, match="--init-from"):
        train_demo.main(["--model", "demo-skills", "--steps", "2"])
    assert train_demo.main(["--model", "demo-skills", "--init-from", str(base), "--steps", "2", "--max-files", "150",
                            "--eval-every", "2", "--no-compile", "--checkpoint-dir", str(tmp_path / "c"),
                            "--out", str(out)]) == 0
    record, pretrained = (json.loads((folder / "training_log.json").read_text()) for folder in (out, base))
    assert record["recipe"]["skills"] > 0 and [entry["step"] for entry in record["log"]] == [2]
    assert record["pretraining"] == pretrained
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    tuned, original = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    assert tuned.keys() == original.keys() and not all(torch.equal(tuned[k], original[k]) for k in tuned)
