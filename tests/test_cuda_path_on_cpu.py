"""The CUDA path's pieces a CPU can check: its options, graph sizes and padding, the KV budget arithmetic, a padded
decode batch run eagerly, and a clear error when CUDA is asked for and absent."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CopyStaging, tiny_model
from frontend import LLM
from ipc import EngineConfig
from kernels import gemv_choice
from launch.launch import build_parser, engine_config
from workers import gemv_tuning
from workers.cuda_graphs import DecodeBatch, DecodeGraphs, capture_sizes, padded_batch_size
from workers.gpu_memory import MemoryProfile, kv_cache_budget
from workers.layers.attention import Attention, AttentionMetadata
from workers.model_config import load_hf_config
from workers.model_loader import load_model
from workers.quantization.online import quantize_rows

GiB = 2**30


@pytest.mark.parametrize("kwargs, field", [
    ({"device": "gpu"}, "device"),
    ({"device": "cuda:1"}, "device"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.01}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
    ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"cuda_graph_sizes": []}, "cuda_graph_sizes"),
    ({"cuda_graph_sizes": [4, 0]}, "cuda_graph_sizes"),
    ({"cuda_graph_sizes": 8}, "cuda_graph_sizes"),
    ({"cuda_graph_sizes": [2.5]}, "cuda_graph_sizes"),
])
def test_bad_device_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        EngineConfig(model="unused", **kwargs)


def test_device_options_defaults_and_limits():
    config = EngineConfig(model="unused", gpu_memory_utilization=1, cuda_graph_sizes=(4, 1))
    assert (config.device, config.enforce_eager) == ("auto", False)
    assert config.cuda_graph_sizes == [4, 1]
    assert EngineConfig(model="unused").gpu_memory_utilization == 0.9


def test_launcher_flags_in_vllm_spelling_reach_the_engine_config():
    flags = ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--cuda-graph-sizes", "1", "4"]
    config = engine_config(build_parser().parse_args(flags), "unused")
    assert (config.device, config.gpu_memory_utilization, config.enforce_eager) == ("cuda", 0.5, True)
    assert config.cuda_graph_sizes == [1, 4]
    defaults = engine_config(build_parser().parse_args([]), "unused")
    assert (defaults.device, defaults.gpu_memory_utilization, defaults.enforce_eager) == ("auto", 0.9, False)
    with pytest.raises(ValueError, match="^gpu_memory_utilization "):
        engine_config(build_parser().parse_args(["--gpu-memory-utilization", "2"]), "unused")


def test_default_capture_sizes_follow_vllm():
    assert capture_sizes(EngineConfig(model="unused", max_num_seqs=256)) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(EngineConfig(model="unused", max_num_seqs=2048))[-1] == 512
    assert capture_sizes(EngineConfig(model="unused", max_num_seqs=20)) == [1, 2, 4, 8, 16]
    assert capture_sizes(EngineConfig(model="unused", max_num_seqs=3)) == [1, 2]


def test_configured_capture_sizes_are_sorted_deduplicated_and_within_max_num_seqs():
    config = EngineConfig(model="unused", max_num_seqs=32, cuda_graph_sizes=[64, 3, 1, 3, 32])
    assert capture_sizes(config) == [1, 3, 32]
    assert capture_sizes(EngineConfig(model="unused", max_num_seqs=4, cuda_graph_sizes=[8])) == []


def test_no_graph_is_captured_past_the_one_the_largest_decode_batch_pads_to():
    """With a 5-token budget a decode batch holds at most 5 sequences: it pads to 8, and 16 and up are never used."""
    assert capture_sizes(EngineConfig(model="unused", max_num_batched_tokens=5)) == [1, 2, 4, 8]
    assert capture_sizes(EngineConfig(model="unused", max_num_batched_tokens=8)) == [1, 2, 4, 8]
    assert capture_sizes(EngineConfig(model="unused", max_num_batched_tokens=9, cuda_graph_sizes=[2, 4])) == [2, 4]


@pytest.mark.parametrize("num_seqs, size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, None)])
def test_a_batch_pads_up_to_the_next_captured_size(num_seqs, size):
    assert padded_batch_size(num_seqs, [1, 2, 4, 8, 16]) == size


def test_padding_rows_write_no_kv_and_attend_one_key_of_block_zero():
    batch = DecodeBatch.padded(np.array([5, 6, 7]), np.array([40, 2, 9]), np.array([201, 18, 73]),
                               np.array([41, 3, 10]), np.array([[12, 9, 3], [2, 0, 0], [4, 0, 0]]), size=5)
    assert batch.input_ids.tolist() == [5, 6, 7, 0, 0]
    assert batch.positions.tolist() == [40, 2, 9, 0, 0]
    assert batch.slot_mapping.tolist() == [201, 18, 73, -1, -1]
    assert batch.seq_lens.tolist() == [41, 3, 10, 1, 1] and batch.seq_lens.dtype == np.int32
    assert batch.block_tables.tolist() == [[12, 9, 3], [2, 0, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_kv_budget_is_the_utilized_share_less_peak_and_memory_outside_torch():
    # 80 GiB device; 6 GiB of weights; the step peaked at 9 GiB; 1.5 GiB in use outside torch (context, others).
    profile = MemoryProfile(total=80 * GiB, free=80 * GiB - 6 * GiB - 3 * GiB // 2, torch_peak=9 * GiB,
                            torch_in_use=6 * GiB)
    assert profile.non_torch == 3 * GiB // 2
    assert kv_cache_budget(profile, 0.9) == 72 * GiB - 9 * GiB - 3 * GiB // 2
    assert kv_cache_budget(profile, 0.5) == 40 * GiB - 9 * GiB - 3 * GiB // 2
    assert kv_cache_budget(profile, 0.1) < 0  # the weights and activations alone exceed 8 GiB


def test_memory_torch_reserved_but_did_not_allocate_is_not_counted_below_zero():
    profile = MemoryProfile(total=10 * GiB, free=10 * GiB, torch_peak=GiB, torch_in_use=GiB)
    assert profile.non_torch == 0
    assert kv_cache_budget(profile, 1.0) == 9 * GiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("in_process", [True, False])
def test_cuda_without_a_gpu_is_a_clear_error_at_engine_start(llama_model, in_process):
    with pytest.raises(ValueError, match="device='cuda', but torch sees no usable GPU"):
        LLM(llama_model, device="cuda", in_process=in_process)


def test_padded_decode_batch_run_eagerly_equals_the_unpadded_batch():
    """What a replayed graph computes, on CPU: the decode graphs' static inputs loaded with a padded batch and run
    through the model give the unpadded batch's hidden states in the real rows and touch no other KV slot."""
    model_dir, block_size = tiny_model("llama"), 8
    model = load_model(model_dir, load_hf_config(model_dir), torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 16, layer.num_kv_heads, block_size, layer.head_dim, generator=generator)
              for layer in layers]
    table = np.array([[3, 7, 1, 12, 9], [4, 0, 0, 0, 0], [10, 11, 2, 0, 0]])
    seq_lens = np.array([37, 5, 20])
    positions = seq_lens - 1
    slots = table[np.arange(3), positions // block_size] * block_size + positions % block_size
    input_ids = np.array([11, 22, 33])

    def run(args: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
        written = [cache.clone() for cache in caches]
        for layer, cache in zip(layers, written):
            layer.kv_cache = (cache[0], cache[1])
        with torch.inference_mode():
            return model(*args), written

    eager = AttentionMetadata(torch.from_numpy(slots), torch.from_numpy(table), [0, 1, 2, 3], seq_lens.tolist(), 3)
    expected, expected_caches = run((torch.from_numpy(input_ids), torch.from_numpy(positions), eager))
    graphs = DecodeGraphs(model, [1, 2, 4, 8], max_model_len=64, block_size=block_size,
                          num_kv_heads=layers[0].num_kv_heads, device=torch.device("cpu"))
    batch = DecodeBatch.padded(input_ids, positions, slots, seq_lens, table, padded_batch_size(3, graphs.sizes))
    hidden, written = run(graphs.load(batch, CopyStaging()))
    assert hidden.shape[0] == 4 and graphs.block_tables.shape == (8, 8)
    torch.testing.assert_close(hidden[:3], expected, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(16 * block_size, dtype=torch.bool)
    untouched[torch.from_numpy(slots)] = False
    for before, ours, theirs in zip(caches, written, expected_caches):
        by_slot = [c.transpose(2, 3).reshape(2, -1, c.shape[2], c.shape[4]) for c in (before, ours, theirs)]
        assert torch.equal(by_slot[1][:, untouched], by_slot[0][:, untouched]), "a padding row wrote the KV cache"
        torch.testing.assert_close(by_slot[1], by_slot[2], rtol=1e-5, atol=1e-5)


def test_gemv_choice_times_each_group_of_plain_weights_once_and_sets_its_layers(monkeypatch):
    """The one-row products' choice, its GPU timing stubbed: one timing per (shape, dtype, bias) group of plain
    weights and int8 weights scaled per row (their scales timed with them), its result on each layer of the group;
    other quantized weights left out; modes off and always; a bad mode."""
    model_dir = tiny_model("llama")
    model = load_model(model_dir, load_hf_config(model_dir), torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if hasattr(m, "gemv_config") and m.weight.dim() == 2]
    biased = model.model.layers[0].self_attn.o_proj  # the other layer's o_proj: same shape, no bias, another group
    biased.bias = torch.nn.Parameter(torch.zeros(biased.weight.shape[0]), requires_grad=False)
    quantized = model.model.layers[0].mlp.down_proj  # a scale, but not an int8 weight: never streamed
    quantized.weight_scale = torch.ones(quantized.weight.shape[0])
    int8 = model.model.layers[1].mlp.down_proj
    int8.weight.data, int8.weight_scale = quantize_rows(int8.weight.data)
    plain = [m for m in layers if m is not quantized]

    def group_of(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        return tuple(weight.shape), weight.dtype, bias is not None

    timed = []

    def choose(products, dtype):
        assert dtype == torch.float32
        assert all((s is int8.weight_scale) == (w is int8.weight) for w, b, s in products)
        timed.append({group_of(w, b) for w, b, s in products})
        return gemv_choice.GemvChoice(tuple(products[0][0].shape), "float32", len(products), 2.0, 1.0,
                                      gemv_choice.CONFIGS[len(timed)])

    monkeypatch.setattr(gemv_tuning, "triton_serves", lambda device: True)
    monkeypatch.setattr(gemv_choice, "choose", choose)
    monkeypatch.setenv(gemv_choice.MODE_ENV, "auto")
    choices = gemv_tuning.choose_gemvs(model, torch.float32)
    groups = [group_of(m.weight, getattr(m, "bias", None)) for m in plain]
    assert all(len(products) == 1 for products in timed)  # each timing's products of one group
    timed_groups = [products.pop() for products in timed]
    assert sorted(timed_groups) == sorted(set(groups)) and len(choices) == len(timed_groups)
    config_of = {group: choice.config for group, choice in zip(timed_groups, choices)}
    assert [m.gemv_config for m in plain] == [config_of[group] for group in groups]
    assert quantized.gemv_config is None

    for layer in plain:
        layer.gemv_config = None
    monkeypatch.setenv(gemv_choice.MODE_ENV, "off")
    assert gemv_tuning.choose_gemvs(model, torch.float32) == [] and all(m.gemv_config is None for m in plain)
    monkeypatch.setenv(gemv_choice.MODE_ENV, "always")
    assert gemv_tuning.choose_gemvs(model, torch.float32) == []
    assert all(m.gemv_config == gemv_choice.CONFIGS[0] for m in plain)
    assert quantized.gemv_config is None
    monkeypatch.setenv(gemv_choice.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_TRITON_GEMV='fast'"):
        gemv_tuning.choose_gemvs(model, torch.float32)
