"""The worker's adapters: an LRU of loaded adapters (max_cpu_loras) and max_loras slots of stacked weights in the
layers. Each step names its adapters (the scheduler admits at most max_loras distinct ones); those not in a slot
take the least recently used slot no request of the step needs."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ipc import EngineConfig, LoRARequest
from kernels.backend import triton_serves
from kernels.quantized_matmul import input_size_of
from workers.distributed import parallel_state
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.lora.adapter import LoRAAdapter, LoRAModule, load_adapter
from workers.lora.slots import LoRAContext, LoRALayerSlots, SavedModuleSlots
from workers.lora.targets import resolve


class LoRAManager:
    def __init__(self, model: nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.context = LoRAContext()
        if triton_serves(device):
            capacity = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.context.token_slots = torch.full((capacity,), -1, dtype=torch.int32, device=device)
            model.register_forward_pre_hook(lambda module, args: self.context.new_forward())
        # The stages whose C++ layer adds adapter deltas itself (workers/fast_path/fused_stage.py): told when a layer
        # gets its first adapter slots.
        self.fused_stages = [module for module in model.modules() if hasattr(module, "lora_context")]
        for module in self.fused_stages:
            module.lora_context = self.context
        self.params = dict(model.named_parameters())
        self.embeddings = next((m for m in model.modules() if type(m) is VocabParallelEmbedding), None)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id → slot, least recently used first
        self.layers: list[LoRALayerSlots | SavedModuleSlots] = []

    def slots_for(self, requests: list[LoRARequest | None]) -> list[int]:
        """Each request's slot (-1: the base model), its adapter loaded into one first."""
        needed = {r.lora_int_id: r for r in requests if r is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step; the scheduler admits at most {self.max_loras}")
        for int_id, request in needed.items():
            if int_id in self.slot_of:
                self.slot_of.move_to_end(int_id)
            else:
                self._place(self._adapter(request), needed)
        return [-1 if r is None else self.slot_of[r.lora_int_id] for r in requests]

    def prepare_graphs(self) -> None:
        """Slots in every projection an adapter could target, before CUDA graphs are captured: a graph holds the
        delta of each layer that had slots when it was captured, and of no other."""
        for layer in self.model.modules():
            if isinstance(layer, (Linear, ColumnParallelLinear)):
                self._layer_slots(layer)

    def graph_safe(self, slots: list[int]) -> bool:
        """Whether a step with these slots may replay a graph: not if an adapter brings its own embeddings, whose
        rows are looked up per slot on the host."""
        saved = None if self.embeddings is None else self.embeddings.lora
        return saved is None or all(slot < 0 or saved.tables[slot] is None for slot in slots)

    def set_token_slots(self, slots: list[int]) -> None:
        self.context.set_tokens(slots, self.device)

    def set_row_slots(self, slots: list[int]) -> None:
        self.context.row_groups = LoRAContext.groups_of(slots, self.device)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.loaded.pop(request.lora_int_id, None) or load_adapter(
            request.lora_name, request.lora_int_id, request.lora_path, self.max_rank)
        self.loaded[request.lora_int_id] = adapter
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return adapter

    def _place(self, adapter: LoRAAdapter, needed: dict[int, LoRARequest]) -> None:
        """Into a free slot, else the least recently used one whose adapter this step does not need."""
        taken = set(self.slot_of.values())
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(int_id for int_id in self.slot_of if int_id not in needed)
            slot = self.slot_of.pop(victim)
        for layer in self.layers:
            layer.clear(slot)
        for name, module in adapter.modules.items():
            found = resolve(self.model, self.params, name)
            if found is not None:  # None: a layer of another pipeline stage
                self._set(found[0], found[1], slot, module)
        for name, weight in adapter.saved.items():
            table = self._saved_slots(name)
            if table is not None:
                table.set(slot, weight.to(self.device, self.dtype))
        self.slot_of[adapter.int_id] = slot

    def _set(self, layer: nn.Module, part: int | None, slot: int, module: LoRAModule) -> None:
        """This rank's share of A and B into the layer's slot: column-parallel parts take their output rows,
        row-parallel layers their input columns (B whole: the delta is a partial sum like the product)."""
        slots = self._layer_slots(layer)
        a, b = module.a.to(self.device, self.dtype), module.b.to(self.device, self.dtype)
        if isinstance(layer, RowParallelLinear):
            start, end = layer.input_range
            slots.set(slot, 0, a[:, start:end], b)
        elif isinstance(layer, ColumnParallelLinear):
            parts = range(len(layer.ranges)) if part is None else [part]
            for index in parts:  # part None over several parts: one fused module (Phi-3's qkv_proj)
                offset = sum(layer.full_sizes[:index]) if part is None else 0
                start, end = layer.ranges[index]
                slots.set(slot, index, a, b[offset + start:offset + end])
        else:
            slots.set(slot, 0, a, b)

    def _layer_slots(self, layer: nn.Module) -> LoRALayerSlots:
        if layer.lora is None:
            parts = layer.output_sizes if isinstance(layer, ColumnParallelLinear) else [layer.weight.shape[0]]
            columns = input_size_of(layer.weight) if layer.weight_scale is not None else layer.weight.shape[1]
            layer.lora = LoRALayerSlots(self.context, parts, columns, self.max_loras, self.max_rank, self.dtype,
                                        self.device)
            self.layers.append(layer.lora)
            for stage in self.fused_stages:
                stage.forget_fused_layers()
        return layer.lora

    def _saved_slots(self, name: str) -> SavedModuleSlots | None:
        """The LM head's or the embeddings' per-slot replacement tables; None where this rank holds neither."""
        kind = ParallelLMHead if name == "lm_head" else VocabParallelEmbedding
        layer = next((m for m in self.model.modules() if type(m) is kind), None)
        if layer is None or (kind is ParallelLMHead and not parallel_state().is_driver):
            return None
        if layer.lora is None:
            layer.lora = SavedModuleSlots(self.context, self.max_loras)
            self.layers.append(layer.lora)
        return layer.lora

