"""The routed experts of a mixture-of-experts layer: weights stacked per expert, routing, TP or expert parallel."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fused_moe import fused_experts, select_experts
from workers.distributed import parallel_state, shard_range, tp_all_reduce, uneven_share
from workers.expert_group import exchange_tokens
from workers.layers.linear import Sliceable, copy_checked

# model.layers.3.mlp.experts.7.gate_proj.weight → ("model.layers.3.mlp.experts", 7, "gate_proj")
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


@dataclass(frozen=True)
class Routing:
    """How a token picks its experts (see kernels.fused_moe_ref.select_experts)."""

    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0


class FusedMoE(nn.Module):
    """Experts' SwiGLU MLPs stacked: gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden, inter].

    Under TP every rank holds every expert's slice of the intermediate dimension; with expert parallel each rank
    holds whole experts, a contiguous share of them. Either way each rank's output is a partial sum, all-reduced.
    With data parallel + expert parallel the share is of the ranks of every engine (uneven where they do not divide
    the experts), and each layer exchanges the engines' tokens (workers/expert_group.py).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: Routing) -> None:
        super().__init__()
        state = parallel_state()
        self.routing, self.tp_size, self.num_experts = routing, state.tp_size, num_experts
        self.group = state.experts
        if self.group is not None:
            if num_experts < self.group.size:
                raise ValueError(f"expert parallel over {self.group.size} data-parallel ranks needs at least as "
                                 f"many experts; the model has {num_experts}")
            self.expert_range = uneven_share(num_experts, self.group.rank, self.group.size)
            self.inter_range = (0, intermediate_size)
        elif state.expert_parallel:
            self.expert_range = shard_range(num_experts, state.tp_rank, state.tp_size)
            self.inter_range = (0, intermediate_size)
        else:
            self.expert_range = (0, num_experts)
            self.inter_range = shard_range(intermediate_size, state.tp_rank, state.tp_size)
        local_experts = self.expert_range[1] - self.expert_range[0]
        local_inter = self.inter_range[1] - self.inter_range[0]
        self.gate_up_proj = nn.Parameter(torch.empty(local_experts, 2 * local_inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local_experts, hidden_size, local_inter), requires_grad=False)
        self.gate_up_proj.weight_loader = self.down_proj.weight_loader = self.weight_loader
        # Each expert's kernels.cpu_gemv.pair_weight copies, stacked, where workers.prepacking gives them: the C++
        # layer's products read them.
        self.gate_up_pairs: torch.Tensor | None = None
        self.down_pairs: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: tuple[int, int]) -> None:
        """One expert's gate (shard 0), up (1) or down (0) projection; experts of other ranks are skipped."""
        expert, half = shard_id
        local = expert - self.expert_range[0]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint names expert {expert}; the config has {self.num_experts}")
        if not 0 <= local < param.shape[0]:
            return
        start, end = self.inter_range
        if param is self.gate_up_proj:
            copy_checked(param.data[local].narrow(0, half * (end - start), end - start), loaded[start:end])
        else:
            copy_checked(param.data[local], loaded[:, start:end])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        r = self.routing
        weights, ids = select_experts(router_logits, r.top_k, r.renormalize, r.scoring, r.num_expert_group,
                                      r.topk_group, r.routed_scaling_factor, correction_bias)
        return self.run_experts(x, weights, ids)

    @property
    def splits_whole_experts(self) -> bool:
        """Whether ranks hold whole experts of their own (expert parallel), not a slice of every expert's MLP."""
        return self.group is not None or tuple(self.expert_range) != (0, self.num_experts)

    @property
    def spans_ranks(self) -> bool:
        """Whether its experts are split over ranks (its output then takes a collective)."""
        return self.tp_size > 1 or self.group is not None

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed tokens through the experts; an engine with no tokens passes none (its dummy pass)."""
        if self.group is not None:
            return exchange_tokens(self.group, x, weights, ids, self._local_experts)
        out = self._local_experts(x, weights, ids)
        return tp_all_reduce(out) if self.tp_size > 1 else out

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.expert_range[0])

    def dummy_pass(self) -> None:
        """Take part in the layer's exchange with no tokens of this engine's own."""
        hidden, top_k = self.gate_up_proj.shape[2], self.routing.top_k
        self.run_experts(torch.empty(0, hidden, dtype=self.gate_up_proj.dtype), torch.empty(0, top_k),
                         torch.empty(0, top_k, dtype=torch.int64))


def expert_target(name: str, expert_modules: dict[str, tuple[str, int]]) -> tuple[str, tuple[int, int]] | None:
    """A per-expert checkpoint name → (stacked parameter name, (expert, shard)); None for any other name.
    `expert_modules` maps the checkpoint's projection names to ours, e.g. Mixtral's {"w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["proj"] not in expert_modules:
        return None
    param, shard = expert_modules[match["proj"]]
    return f"{match['prefix']}.{param}", (int(match["expert"]), shard)
