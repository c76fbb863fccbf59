"""The shipped demo model and its draft: what the repo commits loads, still knows Python, and the engine equals HF."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_all_blocks_free
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from launch.demo_corpus import split, stdlib_files
from launch.demo_tokens import token_stream
from launch.shipped import WEIGHTS_DIR, shipped_model
from launch.train_demo import HELD_OUT_FRACTION

MODELS = ("demo", "draft")
# A broken or random weight file scores about ln(4096) = 8.3 nats a token; the trained ones far below (their
# recorded held-out losses are in each folder's training_log.json and in the README).
HELD_OUT_LOSS_BOUND = {"demo": 3.5, "draft": 4.9}


@functools.cache
def held_out_sample(tokens: int = 400) -> torch.Tensor:
    """The first `tokens` + 1 tokens of the training run's held-out files (whole files it never saw)."""
    run = json.loads((WEIGHTS_DIR / "demo" / "training_log.json").read_text())
    _, held = split(stdlib_files(), HELD_OUT_FRACTION, run["seed"])
    tokenizer = AutoTokenizer.from_pretrained(shipped_model("demo"))
    return token_stream(tokenizer.backend_tokenizer, [f.text for f in held])[:tokens + 1].long()


def test_weights_are_bf16_share_one_tokenizer_and_the_draft_is_5_to_10x_smaller():
    parameters = {}
    for name in MODELS:
        weights = load_file(shipped_model(name) / "model.safetensors")
        assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values()), name
        parameters[name] = sum(tensor.numel() for tensor in weights.values())
    assert 5 <= parameters["demo"] / parameters["draft"] <= 10
    demo, draft = shipped_model("demo"), shipped_model("draft")
    assert (demo / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    shipped_bytes = sum(path.stat().st_size for folder in (demo, draft) for path in folder.iterdir())
    assert shipped_bytes <= 32 * 2**20


@pytest.mark.parametrize("name", MODELS)
def test_held_out_loss_of_a_few_hundred_tokens_stays_under_the_bound(name):
    tokens = held_out_sample()
    model = AutoModelForCausalLM.from_pretrained(shipped_model(name), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens[None, :-1]).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, tokens[1:]).item()
    assert loss < HELD_OUT_LOSS_BOUND[name]


def test_greedy_engine_equals_hf_float32_on_code_chat_and_held_out_text():
    folder = str(shipped_model("demo"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function `is_even(n)`: "
                                           "Return True if n is even."}], tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("def fibonacci(n):", chat)]
    prompts.append(held_out_sample()[:100].tolist())
    llm = LLM(folder, dtype="float32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(folder, prompt, 40)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_shipped_draft_speeds_the_demo_without_changing_its_greedy_output():
    """The pair trained for speculative decoding: some drafts are accepted, and the output is the plain one."""
    prompts = [{"prompt_token_ids": held_out_sample()[start:start + 60].tolist()} for start in (0, 150, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = {}
    for name, spec in (("plain", None), ("draft", {"method": "draft_model", "model": str(shipped_model("draft")),
                                                   "num_speculative_tokens": 4, "disable_by_batch_size": None})):
        llm = LLM(str(shipped_model("demo")), dtype="float32", in_process=True, speculative_config=spec)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats().spec_decoding
        llm.shutdown()
    assert outputs["draft"] == outputs["plain"]
    assert 0.0 < stats.acceptance_rate < 1.0, stats


def test_a_missing_weight_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("launch.shipped.WEIGHTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m launch.train_demo --model demo"):
        shipped_model("demo")
