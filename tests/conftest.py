"""Shared fixtures: the model maker's tiny models (built once per session) and engine helpers."""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import openai
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU. Triton reads this when a kernel (its own standard
    # library's included) is defined, so it must be set before anything (transformers, say) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from core.engine_spawn import EngineProcess  # noqa: E402
from ipc import EngineConfig  # noqa: E402
from ipc.sockets import private_ipc_address  # noqa: E402
from launch.make_model import make_model  # noqa: E402
from launcher import engine_pid, start_launcher, stop_launcher, throttled  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral", "opt")
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
_MODEL_ROOT = Path(os.environ.get("PAGEDSERVE_TEST_MODELS", Path.home() / ".cache" / "pagedserve" / "test-models"))
_SHARED_PIDS: set[int] = set()  # the session's shared servers and engine, which no test leaves behind


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The C++ CPU kernels built (or loaded) once before any test: every engine the tests start then runs them
    from its first step, not the torch paths until an idle-priority build in each engine process finishes.
    Without a compiler the engines run the torch paths, and the kernels' own tests fail."""
    from kernels import cpu_extension

    cpu_extension.load()


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """After all tests, every engine-core process the tests started has exited."""
    yield
    gc.collect()  # runs the finalizers of LLMs that tests did not shut down explicitly
    assert wait_until(lambda: not child_pids(), timeout=10), f"processes left behind: {child_pids()}"


def pairwise(*axes: list, ids: Callable[[Any], str | None] = lambda value: None) -> list:
    """The product of `axes` as pytest params: a set that has every pair of values of any two axes runs by default
    (picked greedily, in the product's order), the rest of the product is marked slow. A case's id joins its values'
    ids: `ids(value)`, else the value as str (torch's dtypes without "torch.")."""
    cases = list(itertools.product(*axes))

    def pairs(case: tuple) -> set:
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}

    wanted, kept = set().union(*map(pairs, cases)), []
    while wanted:
        best = max(cases, key=lambda case: len(pairs(case) & wanted))
        kept.append(best)
        wanted -= pairs(best)
    return [pytest.param(*case, marks=() if case in kept else pytest.mark.slow,
                         id="-".join(ids(value) or str(value).removeprefix("torch.") for value in case))
            for case in cases]


@functools.cache
def tiny_model(arch: str) -> str:
    """A tiny random model folder of `arch` (cached on disk; the maker skips a folder that matches its spec)."""
    return str(make_model(_MODEL_ROOT / f"{arch}-tiny", arch=arch, size="tiny"))


@functools.cache
def tiny_mtp_model() -> str:
    """The tiny DeepSeek-V3 with a random MTP layer (launch/mtp_layer.py) written beside its weights, cached on disk
    beside tiny_model's (made again when the tiny model's config changes)."""
    import shutil

    from transformers import AutoConfig

    from launch.mtp_layer import MTP_FILE, random_mtp_layer

    source, folder = Path(tiny_model("deepseek_v3")), _MODEL_ROOT / "deepseek_v3-tiny-mtp"
    config = (source / "config.json").read_text()
    if not (folder / MTP_FILE).exists() or (folder / "config.json").read_text() != config:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        random_mtp_layer(AutoConfig.from_pretrained(folder), seed=1).save_into(folder)
    return str(folder)


@functools.cache
def tiny_llava() -> str:
    """The tiny random LLaVA-1.5 folder (launch/make_vision_model.py), cached on disk as tiny_model's are."""
    from launch.make_vision_model import make_llava

    return str(make_llava(_MODEL_ROOT / "llava-tiny"))


@functools.cache
def tiny_llava_next() -> str:
    """The tiny random LLaVA-NeXT folder (launch/make_vision_model.py), cached on disk as tiny_model's are."""
    from launch.make_vision_model import make_llava_next

    return str(make_llava_next(_MODEL_ROOT / "llava-next-tiny"))


@functools.cache
def autoround_model(kind: str) -> tuple[str, str]:
    """(quantized folder, float32 reference folder) of the tiny llama quantized by the auto-round package as
    tests/autoround_checkpoints.py's AUTOROUND_SPECS[kind] says, kept on disk with the test models."""
    from autoround_checkpoints import AUTOROUND_SPECS, autoround_checkpoint

    folder = _MODEL_ROOT / f"llama-tiny-autoround-{kind}"
    return autoround_checkpoint(tiny_model("llama"), folder, AUTOROUND_SPECS[kind])


@functools.cache
def long_context_llama() -> str:
    """The tiny llama with a 64k context, where a request can run for many seconds on any machine (the 1k-context
    one's whole context took 0.15-0.25 s): a test acts while it runs. Serve it with a KV pool for its context."""
    return str(make_model(_MODEL_ROOT / "llama-tiny-64k", arch="llama", size="tiny", max_position_embeddings=1 << 16))


@pytest.fixture(scope="session", params=ARCHS)
def arch_model(request) -> tuple[str, str]:
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_model() -> str:
    return tiny_model("llama")


def serve_tiny_llama(llama_model: str) -> tuple[subprocess.Popen, str]:
    """(launcher process, base URL): the tiny llama served by two gateway processes, with API_KEY and small limits."""
    return start_launcher(["--model", llama_model, "--dtype", "float32", "--max-model-len", "1024", "--api-key",
                           API_KEY, "--api-server-count", "2", "--max-n", "4", "--max-stop", "4"])


@pytest.fixture(scope="module")
def server(llama_model):
    """serve_tiny_llama's server, one for the module (not the session: an idle server's engine and gateways still
    poll, a neighbour to every later test that times itself): tests that use it leave it as they found it (their
    metrics are differences) and stop only servers of their own."""
    process, base_url = serve_tiny_llama(llama_model)
    with shared(process.pid):
        yield process, base_url
        stop_launcher(process)


@pytest.fixture(scope="module")
def demo_server() -> str:
    """The base URL of the demo server (`python -m launch`, no model) with API_KEY, keeping two stored responses;
    one for the module (as server's)."""
    process, base_url = start_launcher(["--api-key", API_KEY, "--max-stored-responses", "2"])
    with shared(process.pid):
        yield base_url
        stop_launcher(process)


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's server."""
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key=API_KEY, max_retries=0)


def metric(base_url: str, name: str) -> float:
    """A Prometheus metric of the gateway at base_url, summed over its labels."""
    text = httpx.get(f"{base_url}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@contextlib.contextmanager
def engine_slowed(server: tuple[subprocess.Popen, str], request: dict):
    """The server's engine at a tenth of the CPU (launcher.throttled), so that a test sees `request`'s work in flight
    where a fast machine would finish it between two polls; the same request's first-time costs (a fresh engine's lazy
    set-up) paid unthrottled first (4 tokens, not streamed): at a tenth of the CPU they kept the engine from answering
    a /metrics read within its 5 s when such a test ran first."""
    warm = httpx.post(f"{server[1]}/v1/completions", json={**request, "max_tokens": 4, "stream": False},
                      headers=AUTH, timeout=60)
    assert warm.status_code == 200
    with throttled(engine_pid(server[0].pid)):
        yield


@pytest.fixture(scope="module")
def engine_address(llama_model):
    """The address of an engine-core process of its own (the tiny llama, float32) for the module's clients."""
    address = private_ipc_address()
    engine = EngineProcess(EngineConfig(model=llama_model, dtype="float32"), address)
    engine.wait_ready()
    with shared(engine.pid):
        yield address
        assert engine.is_alive(), "the engine core died during the tests"
        engine.shutdown()


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == llm.info.num_kv_blocks, stats
    assert stats.num_running == 0 and stats.num_waiting == 0, stats


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@contextlib.contextmanager
def shared(pid: int):
    """Within: child_pids() leaves out the session's process `pid` (a shared server is no test's leftover)."""
    _SHARED_PIDS.add(pid)
    try:
        yield
    finally:
        _SHARED_PIDS.discard(pid)


def child_pids() -> list[int]:
    """Live (not zombie) processes whose parent is this test process, but for the session's shared ones."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(entry.name) not in _SHARED_PIDS:
                pids.append(int(entry.name))
    return pids


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class CopyStaging:
    """PinnedStaging's interface with plain copies: the CUDA path's staging, on CPU."""

    def begin_step(self) -> None:
        """No buffers to switch."""

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    def copy_into(self, target: torch.Tensor, array: np.ndarray) -> None:
        target.copy_(torch.from_numpy(array))
