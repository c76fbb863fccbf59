"""GGUF files (llama.cpp's format) for the llama, mistral, qwen2 and Gemma 3 (text) families, read with the `gguf`
package: tensors renamed to the HF checkpoint names, llama's q/k rows put back in HF's rotary order, Gemma's norms
(stored as 1 + w) back to w, F32/F16/BF16 as they are, Q8_0 kept int8 (blocks of 32 with one scale: the grouped int8
kernels), every other type (Q4_0 as Gemma 3's QAT files hold, Q4_K, Q5_K, Q6_K, ...) dequantized to the model dtype
at load by the gguf package. What a GGUF does not store comes from the family's config defaults, as transformers
reads the file (Gemma 3: its layer pattern, five sliding layers to one global, and query_pre_attn_scalar, which
llama.cpp also fixes by the model's size)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from workers.quantization.formats import QuantizedTensors

ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "gemma3_text": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_CLASSES)
# llama.cpp's converter interleaves the rotary halves of q and k rows for these (its kernels rotate pairs).
PERMUTED_ARCHITECTURES = ("llama", "mistral")
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gemma's layers have four norms, named by llama.cpp after where they sit.
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                     "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
OFFSET_NORM_ARCHITECTURES = ("gemma3_text",)
GEMMA3_27B_LAYERS = 62  # norms scale by 1 + w; llama.cpp stores 1 + w
SKIPPED = ("rope_freqs",)  # computed from the config's rope parameters
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # 32 int8 values after one float16 scale
# The gguf package is imported where a GGUF file is read (0.2 s): every engine imports this module, few read GGUF.


def is_gguf(model: str) -> bool:
    return model.endswith(".gguf") and Path(model).is_file()


def load_gguf_config(path: str) -> PretrainedConfig:
    """The HF config transformers derives from the file's metadata; ValueError for other architectures."""
    from gguf import GGUFReader

    config = AutoConfig.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF model {path!r} is a {config.model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    config.architectures = [ARCHITECTURE_CLASSES[config.model_type]]
    reader = GGUFReader(path)
    # llama.cpp writes no output.weight for a head tied to the embeddings.
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    if config.model_type == "gemma3_text":
        _gemma3_from_file(config, reader)
    return config


def _gemma3_from_file(config: PretrainedConfig, reader) -> None:
    """What transformers' reading leaves out and llama.cpp keeps or derives: the global layers' rope scaling (the 4B
    and larger: linear, factor 8), and the 27B's query_pre_attn_scalar (llama.cpp: hidden / heads for its 62 layers;
    head_dim, the default's 256, for the other sizes)."""
    kind, factor = _metadata(reader, "gemma3.rope.scaling.type"), _metadata(reader, "gemma3.rope.scaling.factor")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"Gemma 3 GGUF rope scaling {kind!r} is not supported (supported: linear)")
        config.rope_parameters["full_attention"] = {**config.rope_parameters["full_attention"],
                                                    "rope_type": "linear", "factor": float(factor)}
    if config.num_hidden_layers == GEMMA3_27B_LAYERS:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads


def _metadata(reader, key: str):
    """A scalar or string metadata value of the file (None when absent)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else value.item()


class GGUFCheckpoint:
    """The file's tensors under HF names (a reader as load_weights uses one): Q8_0 ones are `quantized`."""

    name = "gguf"

    def __init__(self, path: str, config: PretrainedConfig) -> None:
        from gguf import GGUFReader, GGMLQuantizationType

        self.reader = GGUFReader(path)
        self.config = config
        self.permuted = config.model_type in PERMUTED_ARCHITECTURES
        self.offset_norms = config.model_type in OFFSET_NORM_ARCHITECTURES
        layer_names = GEMMA_LAYER_NAMES if self.offset_norms else LAYER_NAMES
        self.tensors = {}
        for tensor in self.reader.tensors:
            hf_name = _hf_name(tensor.name, layer_names)
            if hf_name is not None:
                self.tensors[hf_name] = tensor
        self.q8_0 = GGMLQuantizationType.Q8_0

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor in HF layout: floats, or (Q8_0) its raw blocks [N, K / 32 * 34] as uint8."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        kind = tensor.tensor_type.name
        data = np.asarray(tensor.data)
        if kind in ("F32", "F16"):
            values = torch.from_numpy(data.copy())
        elif kind == "BF16":
            values = torch.from_numpy(data.copy()).view(torch.bfloat16)
        elif tensor.tensor_type == self.q8_0:
            values = torch.from_numpy(data.copy())
        else:
            values = torch.from_numpy(dequantize(data, tensor.tensor_type).copy())
        if self.offset_norms and name.endswith("norm.weight"):
            values = values - 1
        return self._rotary_order(name, values)

    def _rotary_order(self, name: str, values: torch.Tensor) -> torch.Tensor:
        if not self.permuted or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return values
        heads = self.config.num_attention_heads if "q_proj" in name else self.config.num_key_value_heads
        rows = values.shape[0]
        return values.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1)

    # The CheckpointFormat protocol: Q8_0 weights are the quantized modules.
    def quantized_module(self, tensor_name: str) -> str | None:
        tensor = self.tensors.get(tensor_name)
        if tensor is None or tensor.tensor_type != self.q8_0 or not tensor_name.endswith(".weight"):
            return None
        return tensor_name[:-len(".weight")]

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [module + ".weight"]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        blocks = tensors["weight"]
        rows = blocks.shape[0]
        blocks = blocks.reshape(rows, -1, Q8_0_BYTES)
        scale = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, -1).float()
        weight = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        return QuantizedTensors(weight.contiguous(), scale.contiguous()).check(module)


def _hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{kind}"
    if base in SKIPPED:
        return None
    raise ValueError(f"GGUF tensor {name!r} has no place in the supported architectures")
