"""The MoE and LoRA kernels are CUDA-graph safe: they equal their torch twins for any routing or mix of adapter slots
(under the Triton interpreter on CPU), and their launch preparation runs on the meta device, where any value read
on the host (.item(), .tolist(), nonzero, a shape taken from the data) raises: every grid follows from shapes."""
from __future__ import annotations

import pytest
import torch
import triton

from kernels import fused_moe_ref, lora_ref
from kernels.row_blocks import group_blocks, max_blocks
from workers.lora.slots import LoRAContext, LoRALayerSlots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_rows, num_groups, block", [(1, 8, 16), (37, 6, 4), (50, 3, 16), (0, 4, 16)])
def test_group_blocks_puts_each_member_once_in_a_block_of_its_group(num_rows, num_groups, block):
    """Rows of no group (-1, or past the groups) left out; groups without rows take no block."""
    generator = torch.Generator().manual_seed(num_rows)
    group_of_row = torch.randint(-1, num_groups + 1, (num_rows,), generator=generator)
    rows, block_group = group_blocks(group_of_row.to(DEVICE), num_groups, block)
    rows, block_group = rows.cpu().long(), block_group.cpu().long()
    assert block_group.numel() == max_blocks(num_rows, num_groups, block)
    assert rows.numel() == block_group.numel() * block
    assert torch.equal(block_group, block_group.sort().values), "blocks in group order, the unused ones last"
    placed = []
    for index, group in enumerate(block_group.tolist()):
        members = rows[index * block:(index + 1) * block]
        members = members[members < num_rows]
        assert group < num_groups or members.numel() == 0
        assert (group_of_row[members] == group).all()
        placed += members.tolist()
    member = (group_of_row >= 0) & (group_of_row < num_groups)
    assert sorted(placed) == torch.nonzero(member).flatten().tolist()
    used_blocks = sum(-(-int((group_of_row == g).sum()) // block) for g in range(num_groups))
    assert int((block_group < num_groups).sum()) == used_blocks


@pytest.mark.parametrize("tokens, experts, top_k, first_expert, local", [
    (1, 8, 2, 0, 8),  # most experts get nothing
    (3, 16, 2, 0, 16),
    (9, 8, 2, 4, 4),  # an expert-parallel share: some choices go to other ranks' experts
    (2, 8, 1, 6, 2),
])
def test_fused_moe_with_idle_experts_equals_twin(tokens, experts, top_k, first_expert, local):
    from kernels import fused_moe_triton

    generator = torch.Generator().manual_seed(tokens * experts)
    hidden, inter = 40, 24
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(local, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(local, hidden, inter, generator=generator) / inter**0.5
    weights, ids = fused_moe_ref.select_experts(torch.randn(tokens, experts, generator=generator), top_k, True)
    expected = fused_moe_ref.fused_experts(x, gate_up, down, weights, ids, first_expert)
    got = fused_moe_triton.fused_experts(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)),
                                         first_expert=first_expert)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_lora_delta_for_any_mix_of_row_slots_equals_twin():
    """Slots in no order, rows of the base model (-1) between them, a slot of no row."""
    from kernels import lora_triton

    generator = torch.Generator().manual_seed(3)
    k, n, ranks = 40, 72, 24
    slots = [2, -1, 0, 2, 2, -1, 0, 3, 2, -1, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0]
    x = torch.randn(len(slots), k, generator=generator)
    a, b = torch.randn(4, ranks, k, generator=generator), torch.randn(4, n, ranks, generator=generator)
    expected = torch.zeros(len(slots), n)
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected[row] = lora_ref.lora_delta(x[row:row + 1], a, b, [(slot, 0, 1)])[0]
    got = lora_triton.lora_delta_rows(x.to(DEVICE), a.to(DEVICE), b.to(DEVICE),
                                      torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-3, rtol=1e-4)


class _Recorder:
    """Stands for a Triton kernel: records each launch's grid instead of running it."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_meta_tensors_catch_every_host_read():
    """What the tests below rely on: on the meta device a value read by the host, or a shape taken from the data,
    raises."""
    ids = torch.zeros(6, dtype=torch.long, device="meta")
    for read in (lambda: int(ids.sum()), ids.tolist, ids.nonzero, torch.bincount, lambda: ids[ids > 0]):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read(ids) if read is torch.bincount else read()


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 64, 2), (24, 8, 2)])
def test_moe_launches_are_prepared_without_reading_the_routing(monkeypatch, tokens, experts, top_k):
    """Routing and both launches on the meta device; the grids follow from the tokens, top-k and experts alone."""
    from kernels import fused_moe_triton

    kernel = _Recorder()
    monkeypatch.setattr(fused_moe_triton, "_expert_matmul_kernel", kernel)
    hidden, inter = 64, 96
    with torch.device("meta"):
        x = torch.empty(tokens, hidden)
        weights, ids = fused_moe_ref.select_experts(torch.empty(tokens, experts), top_k, True)
        out = fused_moe_triton.fused_experts(x, torch.empty(experts, 2 * inter, hidden),
                                             torch.empty(experts, hidden, inter), weights, ids)
    assert out.shape == (tokens, hidden)
    blocks = max_blocks(tokens * top_k, experts, fused_moe_triton.BLOCK_M)
    assert kernel.grids == [(blocks, triton.cdiv(2 * inter, fused_moe_triton.BLOCK_N)),
                            (blocks, triton.cdiv(hidden, fused_moe_triton.BLOCK_N))]


def test_lora_layer_delta_is_prepared_without_reading_the_slots(monkeypatch):
    """A LoRA layer's CUDA path on the meta device, slots read from the context's persistent buffer: the grids
    follow from the rows and max_loras alone, whatever the step's slots."""
    from kernels import lora_triton
    from workers.lora import slots as slots_module

    shrink, expand = _Recorder(), _Recorder()
    monkeypatch.setattr(lora_triton, "_shrink_kernel", shrink)
    monkeypatch.setattr(lora_triton, "_expand_kernel", expand)
    monkeypatch.setattr(slots_module, "use_triton", lambda tensor: True)
    meta = torch.device("meta")
    context = LoRAContext(token_slots=torch.full((16,), -1, dtype=torch.int32, device=meta))
    layer = LoRALayerSlots(context, [48, 16, 16], 32, max_loras=4, max_rank=8, dtype=torch.float32, device=meta)
    for step_slots in ([0, -1, 3], [-1, -1, -1], [1, 1, 2]):
        context.set_tokens(step_slots, meta)
        out = layer.add_delta(torch.empty(3, 32, device=meta), torch.empty(3, 80, device=meta))
        assert out.shape == (3, 80)
    blocks = max_blocks(3, 4, lora_triton.BLOCK_M)
    assert shrink.grids == [(blocks,)] * 3
    assert expand.grids == [(blocks, triton.cdiv(80, lora_triton.BLOCK_N))] * 3
    # The rows are grouped once per forward pass, whatever the number of adapted layers.
    groupings = []
    row_blocks = lora_triton.row_blocks
    monkeypatch.setattr(lora_triton, "row_blocks", lambda *args: groupings.append(args) or row_blocks(*args))
    other = LoRALayerSlots(context, [32], 80, max_loras=4, max_rank=8, dtype=torch.float32, device=meta)
    for _ in range(2):
        context.new_forward()
        out = layer.add_delta(torch.empty(3, 32, device=meta), torch.empty(3, 80, device=meta))
        other.add_delta(out, torch.empty(3, 32, device=meta))
    assert len(groupings) == 2


def test_token_slot_buffer_holds_the_step_and_minus_one_past_it():
    """The graph of a padded batch reads its padding rows' slots as -1 (the base model) after a larger step."""
    context = LoRAContext(token_slots=torch.full((6,), -1, dtype=torch.int32))
    context.set_tokens([0, 1, -1, 2], torch.device("cpu"))
    context.set_tokens([3, 3], torch.device("cpu"))
    assert context.token_slots.tolist() == [3, 3, -1, -1, -1, -1]
    assert context.slots_of_rows(4).tolist() == [3, 3, -1, -1]
    context.set_tokens([1] * 8, torch.device("cpu"))  # more tokens than the buffer: a tensor of the step's own
    assert context.slots_of_rows(8).tolist() == [1] * 8
    assert context.slots_of_rows(9).tolist() == [-1] * 9


def test_lora_layer_triton_path_equals_the_torch_path_and_a_cleared_slot_adds_nothing(monkeypatch):
    """A merged q/k/v-like layer with adapters in slots 0 and 2 (slot 2's touching one part only), tokens of both
    and of the base model interleaved: the Triton path (every row, slots from the buffer) adds what the torch path
    (runs of grouped rows) does; once slot 2 is cleared its rows get nothing, as the torch path skips it."""
    from workers.lora import slots as slots_module

    generator = torch.Generator().manual_seed(7)
    device, k = torch.device(DEVICE), 40
    context = LoRAContext(token_slots=torch.full((16,), -1, dtype=torch.int32, device=device))
    layer = LoRALayerSlots(context, [24, 8, 8], k, max_loras=4, max_rank=4, dtype=torch.float32, device=device)
    for part, size in enumerate([24, 8, 8]):
        layer.set(0, part, torch.randn(4, k, generator=generator), torch.randn(size, 4, generator=generator))
    layer.set(2, 1, torch.randn(2, k, generator=generator), torch.randn(8, 2, generator=generator))
    x, base = torch.randn(7, k, generator=generator).to(device), torch.randn(7, 40, generator=generator).to(device)
    context.set_tokens([2, -1, 0, 0, 2, -1, 0], device)

    def both_paths() -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        for triton_path in (True, False):
            monkeypatch.setattr(slots_module, "use_triton", lambda tensor: triton_path)
            outputs.append(layer.add_delta(x, base.clone()))
        return outputs[0], outputs[1]

    got, expected = both_paths()
    assert not torch.equal(expected[[0, 2, 3, 4, 6]], base[[0, 2, 3, 4, 6]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    layer.clear(2)
    got, expected = both_paths()
    assert torch.equal(got[[0, 1, 4, 5]], base[[0, 1, 4, 5]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_graphs_are_captured_for_mixtures_of_experts_unless_their_experts_span_ranks():
    from types import SimpleNamespace

    from workers.layers.fused_moe import FusedMoE, Routing
    from workers.runner_caches import RunnerCaches

    with torch.device("meta"):
        moe = FusedMoE(8, 16, 32, Routing(top_k=2, renormalize=True))
    runner = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(enforce_eager=False),
                             parallel=SimpleNamespace(tp_size=1, pp_size=1), model=torch.nn.Sequential(moe))
    assert RunnerCaches._captures_cuda_graphs(runner)
    moe.group = SimpleNamespace(size=2)  # experts spread over data-parallel engines: their exchange stays eager
    assert not RunnerCaches._captures_cuda_graphs(runner)
