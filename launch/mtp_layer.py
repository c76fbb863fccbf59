"""DeepSeek-V3's multi-token-prediction layer in plain torch on transformers' decoder layer: what trains and writes a
checkpoint's model.layers.{num_hidden_layers}.* tensors, and the float32 reference the engine's MTP proposer
(workers/spec_decode/mtp.py) is checked against."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                                  DeepseekV3RotaryEmbedding)

MTP_FILE = "mtp.safetensors"
_EXPERTS = "mlp.experts."


class HfMtpLayer(nn.Module):
    """At position p: [enorm(embedding of token p + 1), hnorm(the target's final hidden state at p)] projected, one
    decoder layer (its residual included), and a head of its own after a norm: logits for token p + 2."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.enorm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = DeepseekV3RotaryEmbedding(config)

    def forward(self, next_token_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """next_token_ids [batch, T] (token p + 1 at row p), target_hidden [batch, T, hidden] (h_p, after the
        target's final norm); causal over the T positions from 0. Returns the layer's output (before the head)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_token_ids)), self.hnorm(target_hidden)], -1))
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        return self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                          position_ids=positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors under DeepSeek-V3's checkpoint names (the decoder layer's as transformers names them)."""
        prefix = f"model.layers.{self.config.num_hidden_layers}."
        tensors = {name.removeprefix("layer."): tensor for name, tensor in self.state_dict().items()
                   if not name.startswith("rotary.")}
        # transformers holds the experts stacked; checkpoints store each expert's projections
        gate_up, down = tensors.pop(_EXPERTS + "gate_up_proj", None), tensors.pop(_EXPERTS + "down_proj", None)
        for expert in range(0 if gate_up is None else gate_up.shape[0]):
            gate, up = gate_up[expert].chunk(2)
            tensors |= {f"{_EXPERTS}{expert}.gate_proj.weight": gate, f"{_EXPERTS}{expert}.up_proj.weight": up,
                        f"{_EXPERTS}{expert}.down_proj.weight": down[expert]}
        return {prefix + name: tensor.detach().contiguous() for name, tensor in tensors.items()}

    def save_into(self, folder: str | Path) -> None:
        """Write its tensors beside a checkpoint's own (the loaders read every *.safetensors file of the folder)."""
        save_file(self.checkpoint_tensors(), str(Path(folder) / MTP_FILE))


@torch.no_grad()
def random_mtp_layer(config: PretrainedConfig, seed: int = 0) -> HfMtpLayer:
    """Random weights of the checkpoints' scale: norms one, every other weight (the stacked experts too) normal at
    initializer_range, routing biases drawn."""
    torch.manual_seed(seed)
    layer = HfMtpLayer(config).float()
    for name, param in layer.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, config.initializer_range)
    for name, buffer in layer.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.uniform_(-0.05, 0.05)
    return layer


def load_mtp_layer(folder: str | Path, config: PretrainedConfig) -> HfMtpLayer:
    """The layer a folder's MTP_FILE holds (float32)."""
    layer = HfMtpLayer(config).float()
    prefix, top = f"model.layers.{config.num_hidden_layers}.", ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.",
                                                                "shared_head.")
    state = {(short if short.startswith(top) else "layer." + short): tensor
             for short, tensor in ((name.removeprefix(prefix), tensor)
                                   for name, tensor in load_file(str(Path(folder) / MTP_FILE)).items())}
    experts = sorted({int(name.split(".")[3]) for name in state if name.startswith("layer." + _EXPERTS)})
    if experts:
        expert = [{part: state.pop(f"layer.{_EXPERTS}{e}.{part}_proj.weight") for part in ("gate", "up", "down")}
                  for e in experts]
        state["layer." + _EXPERTS + "gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in expert])
        state["layer." + _EXPERTS + "down_proj"] = torch.stack([e["down"] for e in expert])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    if unexpected or any(not name.startswith("rotary.") for name in missing):
        raise ValueError(f"{folder}: {MTP_FILE} does not match the config's MTP layer ({missing}, {unexpected})")
    return layer
