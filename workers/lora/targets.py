"""Where an adapter's modules land in the engine's model: HF module names resolved as checkpoint weights are (merged
projections take their part), and a check of a whole adapter against a model's layers."""
from __future__ import annotations

from torch import nn

from workers.layers.linear import ColumnParallelLinear, Linear
from workers.lora.adapter import LoRAAdapter
from workers.model_loader import checkpoint_target


def resolve(model: nn.Module, params: dict, module: str) -> tuple[nn.Module, int | None] | None:
    """(layer, part of a merged projection or None) of an adapter's module; None where this rank holds none of it
    (another pipeline stage's layer) or the model has no such module."""
    target = checkpoint_target(module + ".weight", params, model)
    if target is None:
        return None
    param_name, part = target
    layer = model.get_submodule(param_name.rpartition(".")[0])
    if not isinstance(layer, (Linear, ColumnParallelLinear)) or not isinstance(part, (int, type(None))):
        raise ValueError(f"LoRA on {module!r} is not supported (only the attention and MLP projections take "
                         "adapters; embeddings and the LM head only as modules_to_save)")
    return layer, part


def check_adapter(model: nn.Module, adapter: LoRAAdapter, path: str, vocab_size: int, hidden_size: int) -> None:
    """ValueError unless every module of the adapter is a projection of `model` (a whole model, built on the meta
    device) and its A/B shapes fit it; the weights of modules_to_save must have the table's shape."""
    params = dict(model.named_parameters())
    unmatched = []
    for name, module in adapter.modules.items():
        found = resolve(model, params, name)
        if found is None:
            unmatched.append(name)
            continue
        layer, part = found
        rows, columns = _full_shape(layer, part)
        if module.a.shape[1] != columns or module.b.shape[0] != rows:
            raise ValueError(f"LoRA adapter {path!r}: {name!r} has A {tuple(module.a.shape)} and B "
                             f"{tuple(module.b.shape)}; this model's module takes {columns} inputs and {rows} outputs")
    if unmatched:
        raise ValueError(f"LoRA adapter {path!r}: {len(unmatched)} of its modules match no module of this model "
                         f"(e.g. {unmatched[0]!r}); it was made for another model")
    for name, weight in adapter.saved.items():
        if tuple(weight.shape) != (vocab_size, hidden_size):
            raise ValueError(f"LoRA adapter {path!r}: its {name} is {tuple(weight.shape)}, the model's "
                             f"({vocab_size}, {hidden_size})")


def _full_shape(layer: nn.Module, part: int | None) -> tuple[int, int]:
    """(outputs, inputs) of the whole module an adapter's A/B multiply (a single rank's model: tp 1)."""
    columns = getattr(layer, "full_input_size", layer.weight.shape[1])
    if isinstance(layer, ColumnParallelLinear):
        return (layer.full_sizes[part] if part is not None else sum(layer.full_sizes)), columns
    return layer.weight.shape[0], columns
