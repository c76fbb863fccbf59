"""Write a Gemma 3 HF folder as a GGUF file the way llama.cpp lays Gemma 3 out (its QAT checkpoints are Q4_0 GGUF):
llama.cpp's tensor names, every norm stored as 1 + w, projections in the given quantized type, norms in F32. Made
with the gguf package's writer and quantizer; read back by transformers' own GGUF loader as the test's reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.numpy import load_file

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    parts = name.split(".")
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.weight"


def write_gemma3_gguf(folder: str | Path, out: Path, kind: GGMLQuantizationType = GGMLQuantizationType.Q4_0) -> Path:
    """The model in `folder` (Gemma3ForCausalLM, tied head) as a GGUF of `kind` projections at `out`."""
    config = json.loads((Path(folder) / "config.json").read_text())
    writer = GGUFWriter(str(out), "gemma3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    full = config["rope_parameters"]["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_vocab_size(config["vocab_size"])
    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors |= load_file(str(file))
    for name, values in sorted(tensors.items()):
        values = values.astype(np.float32)
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name(name), values + 1)
        elif kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), values)
        else:
            writer.add_tensor(gguf_name(name), quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
