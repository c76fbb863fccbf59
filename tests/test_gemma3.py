"""Gemma 3 (text): greedy float32 equals HF transformers' Gemma3ForCausalLM on a five-layer checkpoint whose sliding
pattern of three does not divide its layers, on the fast path (C++ layers, multi-step calls), chunked and batched,
at tp 2 and from a Gemma3ForConditionalGeneration folder; the layer types' rope bases as transformers reads older
configs; a 262k vocabulary."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from launch.make_model import MARKER_FILE, make_model
from workers.fast_path.later_step_calls import LaterStepCalls

# Six heads of 20 dims (three per rank at tp 2) sharing one KV head; layers sliding, sliding, global, sliding,
# sliding; a 32-token window that the longer prompts pass; the global layers' rope base and linear scaling as
# Gemma 3's larger checkpoints set them; q scaled by query_pre_attn_scalar, not head_dim; final logits capped,
# attention scores not (Gemma 3 sets no attention cap).
ODD = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 20, "num_hidden_layers": 5,
       "sliding_window_pattern": 3, "sliding_window": 32, "query_pre_attn_scalar": 30, "final_logit_softcapping": 3.0,
       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}}
PROMPT_LENGTHS = [1, 9, 33, 70, 140]
MAX_NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# 16-token steps chunk every longer prompt; eight steps per multi-step call.
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 16, "max_model_len": 256, "num_scheduler_steps": 8,
          "multi_step_budget_ms": None}


@functools.cache
def odd_model() -> str:
    """The ODD checkpoint with random norm weights (HF initialises them to zero, so (1 + w) would be 1 and a plain
    RMSNorm would pass): q/k head norms among them, the sandwich norms' outputs large enough that the layers,
    not the scaled embedding, pick the next token."""
    made = make_model(Path(tiny_model("gemma3_text")).parent / "gemma3_text-tiny-odd", arch="gemma3_text",
                      size="tiny", **ODD)
    folder = made.parent / "gemma3_text-tiny-odd-norms"
    if not (folder / MARKER_FILE).exists() or (folder / MARKER_FILE).read_text() != (made / MARKER_FILE).read_text():
        shutil.rmtree(folder, ignore_errors=True)
        staging = made.parent / f"{folder.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(made, staging)
        tensors, generator = load_file(staging / "model.safetensors"), torch.Generator().manual_seed(0)
        for name, tensor in tensors.items():
            if name.endswith("norm.weight"):
                output_norm = ".post_" in name
                tensors[name] = torch.randn(tensor.shape, generator=generator) * (1.0 if output_norm else 0.5) + (
                    4.0 if output_norm else 0.0)
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        staging.rename(folder)
    return str(folder)


@functools.cache
def expected() -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000, seed=3)
    return prompts, [hf_greedy(odd_model(), p, MAX_NEW_TOKENS) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_hf_on_the_fast_path(monkeypatch):
    """Every layer in the C++ layer (q/k head norms of Gemma's kind, each layer type's rotary table and window) and
    the later steps of each multi-step call in one C++ call, batched and chunked: HF's tokens."""
    calls = []
    in_one_call = LaterStepCalls._in_one_call

    def counted(self, steps, count, output, grammars):
        calls.append(in_one_call(self, steps, count, output, grammars))
        return calls[-1]

    monkeypatch.setattr(LaterStepCalls, "_in_one_call", counted)
    prompts, theirs = expected()
    assert len({token for tokens in theirs for token in tokens}) > 2 * len(prompts)  # not one token repeated
    llm = LLM(odd_model(), in_process=True, **ENGINE)
    try:
        model = llm.client.engine.executor.worker.model_runner.model
        windows = [model.model.layers[i].self_attn.attn.sliding_window for i in range(5)]
        assert windows == [32, 32, None, 32, 32]
        for length, ours, reference in zip(PROMPT_LENGTHS, generate(llm, prompts), theirs):
            assert ours == reference, f"{length}-token prompt"
        assert model.model.one_call_layers and model.greedy_model() is not None and any(calls)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_equals_hf():
    """Heads, q/k norms and both rotary tables on two ranks: HF's tokens."""
    prompts, theirs = expected()
    llm = LLM(odd_model(), in_process=True, tensor_parallel_size=2, **ENGINE)
    try:
        assert generate(llm, prompts) == theirs
    finally:
        llm.shutdown()


def test_older_config_keys_give_each_layer_type_its_rope():
    """A config as transformers 4 wrote Gemma 3's (sliding_window_pattern, rope_local_base_freq, rope_theta and
    rope_scaling): sliding layers rotate with the local base, global ones with the scaled global base."""
    from transformers import AutoConfig

    from workers.layers.rotary import RotaryEmbedding
    from workers.models.gemma3 import Gemma3Model

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=4, sliding_window_pattern=3, head_dim=16,
                                  max_position_embeddings=64, rope_local_base_freq=500.0, rope_theta=2e5,
                                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    rotary_of = Gemma3Model.layer_rotary(None, config)
    local = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 500.0})
    unscaled = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 2e5})
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    for layer in (0, 1, 3):
        torch.testing.assert_close(rotary_of(layer).cos, local.cos, rtol=0, atol=0)
    positions = torch.arange(64, dtype=torch.float32)
    angle = positions[:, None] / 4.0 * (1.0 / 2e5 ** (torch.arange(0, 16, 2).float() / 16))[None, :]
    torch.testing.assert_close(rotary_of(2).cos, torch.cat((angle, angle), dim=-1).cos())
    assert not torch.equal(rotary_of(2).cos, unscaled.cos)


def test_a_262k_vocabulary_equals_hf():
    """Gemma 3's vocabulary size: prompt ids and greedy picks far past any small table's end, through the C++
    multi-step calls' embedding rows and LM head."""
    vocab = 262_208
    folder = make_model(Path(tiny_model("gemma3_text")).parent / "gemma3_text-tiny-262k", arch="gemma3_text",
                        size="tiny", vocab_size=vocab)
    prompts = random_prompts([6, 40], vocab=vocab, seed=1)
    theirs = [hf_greedy(str(folder), p, 8) for p in prompts]
    assert max(max(p) for p in prompts) > 200_000
    llm = LLM(str(folder), in_process=True, **ENGINE)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == theirs
    finally:
        llm.shutdown()


def test_conditional_generation_folder_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (a vision tower beside the odd language model's weights): text
    prompts give what HF's Gemma3ForCausalLM gives on those weights; an image is refused."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    text = Path(odd_model())
    for file in text.iterdir():
        if file.name not in ("model.safetensors", "config.json", MARKER_FILE):
            shutil.copy(file, tmp_path / file.name)
    vision = AutoConfig.for_model("siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, image_size=28, patch_size=14)
    config = AutoConfig.for_model("gemma3", text_config=AutoConfig.from_pretrained(text).to_dict(),
                                  vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config)
    weights = load_file(text / "model.safetensors")
    model.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    model.save_pretrained(tmp_path)
    prompts, theirs = expected()
    llm = LLM(str(tmp_path), in_process=True, **ENGINE)
    try:
        assert generate(llm, prompts) == theirs
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate({"prompt": "a", "multi_modal_data": {"image": _image()}}, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _image():
    from PIL import Image

    return Image.new("RGB", (28, 28), (200, 10, 10))


def test_bidirectional_attention_is_refused():
    """EmbeddingGemma's config (use_bidirectional_attention) is an encoder's: refused by name, not served causally."""
    folder = make_model(Path(tiny_model("gemma3_text")).parent / "gemma3_text-tiny-bidirectional", arch="gemma3_text",
                        size="tiny", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention .* is not supported"):
        LLM(str(folder), dtype="float32", in_process=True)
