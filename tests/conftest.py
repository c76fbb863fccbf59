"""Shared fixtures: the model maker's tiny models (built once per session) and engine helpers."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from launch.make_model import make_model

ARCHS = ("llama", "qwen2", "mistral", "opt")
_MODEL_ROOT = Path(os.environ.get("PAGEDSERVE_TEST_MODELS", Path.home() / ".cache" / "pagedserve" / "test-models"))


@functools.cache
def tiny_model(arch: str) -> str:
    """A tiny random model folder of `arch` (cached on disk; the maker skips a folder that matches its spec)."""
    return str(make_model(_MODEL_ROOT / f"{arch}-tiny", arch=arch, size="tiny"))


@pytest.fixture(scope="session", params=ARCHS)
def arch_model(request) -> tuple[str, str]:
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_model() -> str:
    return tiny_model("llama")


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == llm.engine_core.num_kv_blocks, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
