"""MTP: DeepSeek-V3's multi-token-prediction layer as a proposer. It reads the target's final hidden states: at position
p it takes the target's h_p with token p + 1 and predicts token p + 2; further drafts feed its own output back in
place of the target's next hidden state (vLLM's reuse of one layer for k drafts)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from ipc import SpeculativeConfig
from kernels import cpu_decoder_layer, cpu_gemv, cpu_mtp
from kernels.cpu_greedy_decode import GreedyModel
from workers.distributed import parallel_state, single_rank
from workers.layers.linear import Linear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.layers.sampler import Sampler
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.model_config import load_hf_config
from workers.model_inputs import StepRows
from workers.model_loader import load_model
from workers.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from workers.fast_path.fused_stage import FusedStage
from workers.models.llama import head_dim_of
from workers.request_state import CachedRequestState
from workers.spec_decode.feeds import FeedBatch, ProposerCaches, append_drafts

MTP_MODEL_TYPES = ("deepseek_v3",)


class SharedHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class MtpStage(FusedStage):
    """The MTP layer's decoder layer as a stage of one layer, so that its steps run in the C++ decoder layer as the
    target's do (the same results as the op path), with the shared head's norm as its final norm."""

    def __init__(self, layer: MtpLayer) -> None:
        self.layers, self.stage_layers = [layer], [0]

    def final_norm_module(self) -> RMSNorm:
        return self.layers[0].shared_head.norm


class MtpLayer(DeepseekV3DecoderLayer):
    """The checkpoint's layer num_hidden_layers: a decoder layer after a projection of [enorm(embedding of token
    p + 1), hnorm(h_p)], with a head of its own (shared_head)."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(config, config.num_hidden_layers, rotary)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size)
        self.shared_head = SharedHead(config)
        self.stage = MtpStage(self)

    def forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                metadata) -> torch.Tensor:
        """Its hidden states before the head's norm (what the next draft reads in place of the target's). Where its
        decoder layer runs in C++ with the kernels' products, its input rows do too, and its output is summed and
        normed there: as a multi-step call's C++ steps draft (kernels.cpu_mtp), so both draft alike."""
        step = self.stage.fused_step(previous_hidden, positions, metadata)
        parts = self.kernel_parts(previous_hidden.dtype)
        if step is not None and step.kernel_products and parts is not None:
            x = cpu_mtp.mtp_inputs(parts, input_ids, previous_hidden)
        else:
            x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)],
                                       dim=-1))
        if step is not None:
            return self.stage.fused_forward(x, None, step, sums=True)[1]
        x, residual = super().forward(positions, x, None, metadata)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        prepared = self.stage.prepared_layers(hidden.dtype) if self.stage.one_call_layers else None
        normed = self.shared_head.norm(hidden) if prepared is None else cpu_decoder_layer.final_norm(prepared, hidden)
        return self.shared_head.head.compute_logits(normed)

    def kernel_parts(self, dtype: torch.dtype) -> cpu_mtp.MtpParts | None:
        """Its input's parts as the C++ kernels take them, None where they do not (quantized, an adapter's)."""
        embed, eh_proj = self.embed_tokens, self.eh_proj
        if embed.weight_scale is not None or embed.lora is not None or eh_proj.weight_scale is not None \
                or eh_proj.lora is not None \
                or self.enorm.eps != self.hnorm.eps or eh_proj.bias is not None:
            return None
        parts = cpu_mtp.MtpParts(embed.weight, self.enorm.weight, self.hnorm.weight, self.enorm.eps, eh_proj.weight,
                                 eh_proj.pairs_weight)
        return parts if parts.takes(dtype) else None

    def greedy_model(self, dtype: torch.dtype) -> GreedyModel | None:
        """Its decoder layer (with the shared head's norm), embedding and shared head as a multi-step call's C++
        steps take them, where its last steps prepared them for `dtype` (None: not so)."""
        prepared = self.stage.prepared_layers(dtype) if self.stage.one_call_layers else None
        head = self.shared_head.head
        if prepared is None or head.weight_scale is not None or head.lora is not None or head.weight.dtype != dtype:
            return None
        return GreedyModel(prepared, self.embed_tokens.weight, head.weight, head.vocab_size,
                           min(self.stage.product_rows, cpu_gemv.max_rows(dtype, head.weight, head.pairs_weight)),
                           head.pairs_weight)


class MtpModel(nn.Module):
    """The MTP layer with the checkpoint's names (model.layers.{num_hidden_layers}.*); the target's embedding and head
    where the layer's own copies are not stored."""

    packed_modules = DeepseekV3ForCausalLM.packed_modules
    expert_modules = DeepseekV3ForCausalLM.expert_modules

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        self.layer = MtpLayer(config, rotary)
        self.checkpoint_prefixes = {f"model.layers.{config.num_hidden_layers}.": "layer."}
        self.weight_aliases = {"model.embed_tokens.weight": "layer.embed_tokens.weight",
                               "lm_head.weight": "layer.shared_head.head.weight"}


class MtpProposer(ProposerCaches):
    """Held whole by the driver rank, as a draft model is. Its KV at position p is written from the target's h_p when
    the target computes p and token p + 1 is known (observe()); drafts write past the context, and are overwritten
    once the target computes those positions. A block found in the prefix cache keeps the KV the request that computed
    it wrote: at its last position that came from that request's next token (drafts may suffer, never outputs)."""

    reads_hidden_states = True

    def __init__(self, config: SpeculativeConfig, target: str, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_model_len: int, sampler: Sampler) -> None:
        hf_config = load_hf_config(target)
        if hf_config.model_type not in MTP_MODEL_TYPES or not getattr(hf_config, "num_nextn_predict_layers", 0):
            raise ValueError(f"speculative_config method 'mtp' needs a model with a multi-token-prediction layer "
                             f"({MTP_MODEL_TYPES}, num_nextn_predict_layers >= 1); {target!r} is "
                             f"{hf_config.model_type!r}")
        if parallel_state().pp_size > 1:
            raise ValueError("speculative_config method 'mtp' does not run under pipeline parallelism yet")
        self.num_drafts, self.block_size, self.max_model_len = config.num_speculative_tokens, block_size, max_model_len
        self.dtype, self.device, self.sampler = dtype, device, sampler
        with single_rank():
            self.model = load_model(target, hf_config, dtype, device, build=MtpModel).layer
        # Per request after the target's last step: its length then and the layer's output at its last known token.
        self.last: dict[str, tuple[int, torch.Tensor]] = {}
        self.probs: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        self.last.pop(req_id, None)
        self.probs.pop(req_id, None)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.probs.get(req_id)

    def kernel_drafts(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray
                      ) -> cpu_mtp.MtpDrafts | None:
        """Its drafts (all the requests' tokens so far in `contexts`; the positions their blocks give in `capacity`)
        as the target's greedy_decode() writes them in C++, where the layer runs there (prepared by its steps in
        Python for the bound caches): each request's first from its output after the target's last step."""
        return self._kernel_layer(states, contexts, capacity, drafting=True)

    def kernel_observer(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray
                        ) -> cpu_mtp.MtpDrafts | None:
        """As kernel_drafts(), for steps that verify no drafts: the layer only takes their hidden states."""
        return self._kernel_layer(states, contexts, capacity, drafting=False)

    def _kernel_layer(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray,
                      drafting: bool) -> cpu_mtp.MtpDrafts | None:
        model, parts = self.model.greedy_model(self.dtype), self.model.kernel_parts(self.dtype)
        if model is None or parts is None:
            return None
        seeds = torch.zeros(len(states), parts.embedding.shape[1], dtype=self.dtype)
        seeded = np.zeros(len(states), dtype=np.int64)
        for row, (state, context) in enumerate(zip(states, contexts)):
            length, output = self.last.get(state.req_id, (-1, None))
            if length == len(context):
                seeds[row], seeded[row] = output, 1
        return cpu_mtp.MtpDrafts(self.num_drafts, model, parts, seeds, seeded,
                                 np.ascontiguousarray(capacity, dtype=np.int64), drafting)

    def resume(self, states: list[CachedRequestState], drafts: cpu_mtp.MtpDrafts, lengths: np.ndarray) -> None:
        """After greedy_decode() drafted for `states`, now `lengths` tokens long: each one's output after the
        target's last step (its seed), from which propose() drafts next."""
        for row, (state, length) in enumerate(zip(states, lengths.tolist())):
            self.probs.pop(state.req_id, None)
            if drafts.seeded[row]:
                self.last[state.req_id] = (length, drafts.seeds[row].clone())
            else:
                self.last.pop(state.req_id, None)

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, rows: StepRows, requests: dict[str, CachedRequestState],
                sampled: dict[str, list[int]]) -> None:
        """After a target step: every row of `hidden` whose next token is now known (the prompt's, a verified draft,
        the token just sampled) is fed with that token, writing the layer's KV there."""
        states, feeds, inputs = [], [], []
        for req_id, first_row, start, count in rows:
            state = requests[req_id]
            known = state.token_ids + sampled.get(req_id, [])
            count = min(count, len(known) - 1 - start)
            if count > 0 and state.pooling_params is None:
                states.append(state)
                feeds.append((start, known[start + 1:start + 1 + count]))
                inputs.append(hidden[first_row:first_row + count])
        if not states:
            return
        batch = FeedBatch.of(states, feeds, self.block_size, self.device)
        with single_rank():
            out = self.model(batch.input_ids, torch.cat([inputs[i] for i in batch.order]).to(self.dtype),
                             batch.positions, batch.metadata)[batch.last_rows]
        for i, (state, (start, tokens)) in enumerate(zip(states, feeds)):
            if state.req_id in sampled:
                self.last[state.req_id] = (start + len(tokens) + 1, out[i])

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], new_tokens: list[list[int]]) -> list[list[int]]:
        """Drafts after each request's tokens (its state's, then the ones just sampled), from observe()'s outputs."""
        contexts = [state.token_ids + tokens for state, tokens in zip(states, new_tokens)]
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        counts = [min(self.num_drafts, self.max_model_len - len(context))
                  if self.last.get(state.req_id, (-1,))[0] == len(context) else 0
                  for state, context in zip(states, contexts)]
        active = [i for i, count in enumerate(counts) if count > 0]
        hidden = torch.stack([self.last[states[i].req_id][1] for i in active]) if active else None
        with single_rank():
            for step in range(max(counts, default=0)):
                kept = [row for row, i in enumerate(active) if step < counts[i]]
                active, hidden = [active[row] for row in kept], hidden[kept]
                if step:
                    batch = FeedBatch.of([states[i] for i in active],
                                         [(len(contexts[i]) + step - 2, drafts[i][-1:]) for i in active],
                                         self.block_size, self.device)
                    hidden = self.model(batch.input_ids, hidden[batch.order], batch.positions,
                                        batch.metadata)[batch.last_rows]
                append_drafts(self.sampler, self.model.compute_logits(hidden).float(), states, new_tokens, active,
                              drafts, probs)
        for i, state in enumerate(states):
            self.last.pop(state.req_id, None)
            if probs[i]:
                self.probs[state.req_id] = torch.stack(probs[i])
            else:
                self.probs.pop(state.req_id, None)
        return drafts
