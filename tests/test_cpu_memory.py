"""CPU memory placement (workers.cpu_allocator): the KV cache and the weights on 2 MiB-aligned memory advised for
transparent huge pages, with the same values and sharing as before; the memory a load plans on."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_model
from frontend import LLM
from workers.cpu_allocator import available_memory, gather_parameters_in_huge_pages, huge_page_zeros
from workers.model_config import load_hf_config
from workers.model_loader import load_model

HUGE_PAGE = 2 * 2**20


def _thp_mode() -> str:
    """The bracketed choice of Linux's transparent huge page setting ("never" where there is none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps (0 where unknown)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_huge_page_zeros_is_aligned_zeroed_and_advised():
    cache = huge_page_zeros((2, 300, 4, 16, 64), torch.bfloat16)
    assert cache.shape == (2, 300, 4, 16, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert not cache.any()
    cache.fill_(1.0)  # every byte of it is writable; written, its pages are taken
    assert int(cache.float().sum()) == cache.numel()
    if _thp_mode() in ("madvise", "always"):
        assert _huge_bytes_at(cache.data_ptr()) >= HUGE_PAGE
    small = huge_page_zeros((3, 5), torch.float32)  # under one huge page: no advice, same tensor
    assert small.shape == (3, 5) and not small.any()


def test_parameters_move_with_their_values_and_sharing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024, bias=False),
                                torch.nn.Linear(1024, 3, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding table
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = gather_parameters_in_huge_pages(model)
    params = dict(model.named_parameters())
    assert moved >= sum(p.nbytes for p in params.values()) > HUGE_PAGE
    starts = sorted(p.data_ptr() for p in params.values())
    assert starts[0] % HUGE_PAGE == 0 and starts[-1] - starts[0] < moved  # one arena
    assert all(p.data_ptr() % 64 == 0 for p in params.values())
    assert all(torch.equal(params[name], value) for name, value in before.items())
    assert model[1].weight is model[0].weight
    if _thp_mode() in ("madvise", "always"):
        assert _huge_bytes_at(starts[0]) >= HUGE_PAGE
    x = torch.randn(2, 1024)
    assert torch.equal(model(x), torch.nn.functional.linear(torch.nn.functional.linear(
        torch.nn.functional.linear(x, before["0.weight"], before["0.bias"]), before["0.weight"]), before["2.weight"]))


def test_a_model_under_one_huge_page_stays_where_it_is():
    model = tiny_model("llama")
    loaded = load_model(model, load_hf_config(model), torch.float32, torch.device("cpu"))
    assert sum(p.nbytes for p in loaded.parameters()) < HUGE_PAGE
    assert gather_parameters_in_huge_pages(loaded) == 0


def test_engine_cache_is_on_huge_pages():
    llm = LLM(tiny_model("llama"), dtype="bfloat16", in_process=True, num_kv_blocks=8192)
    try:
        caches = llm.client.engine.executor.worker.model_runner.kv_caches
        assert all(cache.data_ptr() % HUGE_PAGE == 0 for cache in caches) and caches[0].nbytes >= 2 * HUGE_PAGE
        if _thp_mode() in ("madvise", "always"):
            assert _huge_bytes_at(caches[0].data_ptr()) > 0
    finally:
        llm.shutdown()


def test_available_memory_counts_the_page_cache_a_load_may_drop():
    """The KV and weight-copy budgets plan on MemAvailable (free memory and reclaimable page cache), not on free
    memory alone, which reading checkpoints shrinks by GBs."""
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024
               for line in Path("/proc/meminfo").read_text().splitlines()}
    assert abs(available_memory() - meminfo["MemAvailable"]) <= 0.05 * meminfo["MemAvailable"]
    assert available_memory() >= meminfo["MemFree"]
