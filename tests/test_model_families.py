"""Families beyond llama (Qwen3, Phi-3, GPT-NeoX, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and V3, Gemma 2 and
3): greedy float32 outputs equal HF transformers on two shapes each, in one batch with chunked prefill, preemption
and prefix-cache hits."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from conftest import assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from launch.make_model import make_model

PROMPT_LENGTHS = [1, 7, 17, 64, 100, 300]
MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# 37-token steps chunk every prompt over 37 tokens; 24 blocks of 16 hold about half of what the batch needs, so
# requests are preempted; the second pass over the same prompts finds blocks of the first in the prefix cache.
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 37, "num_kv_blocks": 24, "max_model_len": 384}
# DeepSeek-V2's long-context rope: YaRN frequencies, cos/sin scaled by mscale / mscale_all_dim, the softmax scale
# by mscale_all_dim's temperature squared.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
# The second shape of each family: odd head counts or head dims, other expert counts and top-k, the variants of
# each family's config (no parallel residual, dense layers between sparse ones, unnormalised routing).
ODD_SHAPES = {
    "qwen3": {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 24},
    "phi3": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 5,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
    "gpt_neox": {"hidden_size": 80, "num_attention_heads": 5, "use_parallel_residual": False,
                 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
    "mixtral": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1, "intermediate_size": 72,
                "num_local_experts": 5, "num_experts_per_tok": 3},
    "qwen2_moe": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1, "num_experts": 6,
                  "num_experts_per_tok": 3, "norm_topk_prob": True, "decoder_sparse_step": 2,
                  "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40},
    "qwen3_moe": {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 24, "num_experts": 5,
                  "num_experts_per_tok": 3, "mlp_only_layers": [0]},
    "deepseek_v2": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 5, "q_lora_rank": 24,
                    "kv_lora_rank": 20, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
                    "topk_method": "greedy", "n_group": None, "topk_group": None, "first_k_dense_replace": 0,
                    "n_shared_experts": 2, "n_routed_experts": 5, "num_experts_per_tok": 3,
                    "routed_scaling_factor": 1.5, "rope_parameters": YARN},
    # Six experts in three groups of two (the best two groups compete), three chosen, the first layer dense.
    "deepseek_v3": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 5, "q_lora_rank": 24,
                    "kv_lora_rank": 20, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
                    "n_group": 3, "topk_group": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
                    "n_shared_experts": 2, "n_routed_experts": 6, "num_experts_per_tok": 3,
                    "routed_scaling_factor": 1.5, "rope_parameters": YARN},
    # Caps low enough to bite at these random weights' scores and logits; query_pre_attn_scalar is not head_dim.
    "gemma2": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 24,
               "query_pre_attn_scalar": 30, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
               "sliding_window": 32},
    # Gemma 3, three layers: sliding, global, sliding; an attention cap in its config, which transformers' Gemma 3
    # reads but does not apply (nor do we).
    "gemma3_text": {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 24,
                    "num_hidden_layers": 3, "query_pre_attn_scalar": 30, "attn_logit_softcapping": 2.0,
                    "final_logit_softcapping": 3.0, "sliding_window": 32},
}
FAMILIES = list(ODD_SHAPES)


def family_model(arch: str, shape: str) -> str:
    if shape == "default":
        return tiny_model(arch)
    folder = Path(tiny_model(arch)).parent / f"{arch}-tiny-odd"
    return str(make_model(folder, arch=arch, size="tiny", **ODD_SHAPES[arch]))


@functools.cache
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, vocab=1000)


# One shape per family by default, both where they take different paths (DeepSeek-V2: group-limited routing without
# q_lora_rank, greedy routing with it); -m slow runs the rest. The dense families' second shapes change only head
# counts and dims, which the kept shapes also do; the first shapes of Mixtral, Qwen2-MoE, Qwen3-MoE and Gemma 2 take
# their second shapes' paths with other counts (Qwen2-MoE's unnormalised top-k: DeepSeek-V2's); Gemma 3's first
# shape too (tests/test_gemma3.py covers its layers more).
DEFAULT_SHAPES = {"qwen3": ("default",), "phi3": ("default",), "gpt_neox": ("default",), "mixtral": ("odd",),
                  "qwen2_moe": ("odd",), "qwen3_moe": ("odd",), "deepseek_v2": ("default", "odd"),
                  "deepseek_v3": ("odd",), "gemma2": ("odd",), "gemma3_text": ("odd",)}


@pytest.mark.parametrize("arch, shape", [
    (arch, shape) if shape in DEFAULT_SHAPES[arch] else pytest.param(arch, shape, marks=pytest.mark.slow)
    for arch in FAMILIES for shape in ("default", "odd")])
def test_greedy_equals_hf_chunked_preempted_and_prefix_cached(arch, shape):
    model = family_model(arch, shape)
    expected = [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts()]
    llm = LLM(model, **ENGINE)
    try:
        for attempt in ("cold", "prefix cached"):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
            for length, output, theirs in zip(PROMPT_LENGTHS, outputs, expected):
                assert output.outputs[0].token_ids == theirs, f"{arch}/{shape} {attempt}: {length}-token prompt"
        stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_fused_checkpoint_tensor_of_the_wrong_size_is_refused(tmp_path):
    """Phi-3's fused qkv_proj is split by the config's sizes: a tensor of another size is an error at load."""
    import torch
    from safetensors.torch import load_file, save_file

    source = Path(family_model("phi3", "default"))
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:16]])
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match="fused checkpoint tensor has 144 rows"):
        LLM(str(tmp_path), dtype="float32", in_process=True)


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_expert_parallel=True)


def test_a_deepseek_config_whose_head_dim_is_not_its_rope_width_is_an_error_at_load():
    """HF's DeepSeek configs set head_dim to qk_rope_head_dim, the rotary table's width; an edited one that does not
    is refused at load (it once passed the load and killed the engine at its first step)."""
    model = make_model(Path(tiny_model("llama")).parent / "deepseek_v3-tiny-head-dim", arch="deepseek_v3",
                       size="tiny", weights=False, head_dim=32)
    with pytest.raises(ValueError, match=r"head_dim \(32\) must equal qk_rope_head_dim \(8\)"):
        LLM(str(model), dtype="float32", in_process=True, load_format="dummy")


def test_mla_caches_one_latent_per_token_not_keys_and_values_per_head():
    """DeepSeek-V2's cache entry per token and layer: kv_lora_rank + qk_rope_head_dim values, instead of the
    2 * heads * head_dim of multi-head attention; a fixed budget holds that many more blocks."""
    from transformers import AutoConfig

    model = family_model("deepseek_v2", "odd")
    config = AutoConfig.from_pretrained(model)
    budget, block_size = 2**20, 16
    llm = LLM(model, dtype="float32", in_process=True, kv_cache_memory=budget, block_size=block_size)
    try:
        per_token = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
        assert llm.info.num_kv_blocks == budget // (block_size * per_token)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("rope", [YARN, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 32768, "truncate": False}])
def test_yarn_frequencies_and_scale_equal_hf(rope):
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.layers.rotary import RotaryEmbedding

    config = AutoConfig.for_model("deepseek_v2", rope_parameters=dict(rope), max_position_embeddings=131072)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = RotaryEmbedding(config.head_dim, 4096, dict(config.rope_parameters))
    positions = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    expected = torch.cat((positions, positions), dim=-1).cos() * attention_factor
    assert attention_factor != 1.0
    torch.testing.assert_close(ours.cos, expected, rtol=0, atol=0)


def test_unsupported_rope_scaling_is_an_error_at_load():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256}
    model = make_model(Path(tiny_model("llama")).parent / "phi3-tiny-longrope", arch="phi3", size="tiny",
                       rope_parameters=rope)
    with pytest.raises(Exception, match="rope_type 'longrope' is not supported"):
        LLM(str(model), dtype="float32", in_process=True)


def test_gemma2_logprobs_are_of_the_soft_capped_logits():
    """tanh capping keeps the argmax, so greedy tokens cannot show it: the logprobs must be HF's (capped) ones."""
    import torch

    from hf_reference import _hf_model, hf_logprobs

    model = family_model("gemma2", "odd")
    prompt = prompts()[2]
    llm = LLM(model, dtype="float32", in_process=True)
    try:
        [output] = llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True),
                                use_tqdm=False)
    finally:
        llm.shutdown()
    completion = output.outputs[0]
    with torch.inference_mode():
        logits = _hf_model(model)(torch.tensor([prompt + completion.token_ids])).logits[0].float()
    assert logits.abs().max() <= 3.0  # the cap is in force
    reference = hf_logprobs(model, prompt + completion.token_ids, len(prompt))
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        torch.testing.assert_close(entry[token].logprob, reference[step, token].item(), atol=1e-4, rtol=0)
