"""Which product serves a one-row x W^T on CUDA, per weight shape: the general one (cuBLAS for plain weights, the
quantized kernel for int8 ones scaled per row), or the Triton GEMV in one of its launch shapes, whichever streamed the
model's own weights of that shape fastest when timed at start-up."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# "auto" (default): timed at start-up; "off": cuBLAS only; "always": the Triton GEMV for every shape, in its first
# launch shape (tests of its wiring, where timing would pick either).
MODE_ENV = "PAGEDSERVE_TRITON_GEMV"
_ROUNDS = 3  # each candidate timed this often, candidates interleaved, its best taken: the device drifts
_MIN_GAIN = 0.02  # Triton must beat the general product by this share: a tie within the timing's noise keeps it


@dataclass(frozen=True)
class GemvConfig:
    """A launch shape: output rows per program, input columns per loop step, warps, software-pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Few rows per program (many programs, so every SM streams), input tiles wide enough for 16-byte loads per thread;
# the last two put as many bytes in flight for int8 weights as the others do for bf16.
CONFIGS = (GemvConfig(8, 512, 4, 3), GemvConfig(16, 256, 4, 3), GemvConfig(16, 512, 4, 3),
           GemvConfig(32, 256, 8, 3), GemvConfig(32, 512, 8, 2), GemvConfig(64, 128, 4, 4),
           GemvConfig(8, 1024, 8, 2), GemvConfig(16, 1024, 8, 2), GemvConfig(8, 2048, 8, 2))


@dataclass(frozen=True)
class GemvChoice:
    """What start-up timing found for one weight shape (and dtype, bias or not): microseconds per product with
    the general product (kernels.matmul.linear without a GEMV: cuBLAS for plain weights) and with the fastest launch
    shape (None: none ran on this GPU), and the launch shape chosen (None: the general product)."""

    shape: tuple[int, int]
    dtype: str
    weights: int
    general_us: float
    triton_us: float | None
    config: GemvConfig | None


def mode() -> str:
    """The choice's mode from MODE_ENV; a value other than auto, off or always is an error."""
    value = os.environ.get(MODE_ENV, "auto")
    if value not in ("auto", "off", "always"):
        raise ValueError(f"{MODE_ENV}={value!r}: expected auto, off or always")
    return value


def choose(products: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]], dtype: torch.dtype
           ) -> GemvChoice:
    """Time the general product and each launch shape on products (weight, bias, scale) of one shape, dtype and bias
    presence, for x of `dtype`, each candidate streaming all of them in turn (from memory, as in a decode step,
    where together they outsize the L2 cache: an 8B model's do; a small model's are timed from L2 alike), replayed
    from a CUDA graph as the decode step's are: launched from Python, a product of a few microseconds would time
    the host's launches instead."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    from kernels import (  # lazily: see kernels.backend; matmul imports this module
        gemv_triton,
        matmul,
    )

    weight = products[0][0]
    x = torch.randn(1, weight.shape[1], dtype=dtype, device=weight.device)

    def streamer(config: GemvConfig | None) -> Callable[[], object]:
        if config is None:
            return lambda: [matmul.linear(x, w, b, s) for w, b, s in products]
        return lambda: [gemv_triton.gemv(x, w, b, config, s) for w, b, s in products]

    graphs = {None: _captured(streamer(None), weight.device)}
    for config in CONFIGS:
        try:
            graphs[config] = _captured(streamer(config), weight.device)
        except (CompilationError, OutOfResources, PTXASError) as error:  # not a candidate on this GPU
            logger.warning("the Triton GEMV's launch shape %s does not run on this GPU: %s", config, error)
    best = {config: float("inf") for config in graphs}
    for _ in range(_ROUNDS):
        for config, graph in graphs.items():
            best[config] = min(best[config], _replay_us(graph) / len(products))
    triton_us = min((us for config, us in best.items() if config is not None), default=None)
    return GemvChoice(tuple(weight.shape), str(weight.dtype).removeprefix("torch."), len(products), best[None],
                      triton_us, pick(best))


def pick(times_us: dict[GemvConfig | None, float]) -> GemvConfig | None:
    """The fastest launch shape where it beats the general product (key None) by more than the timing's noise,
    else None."""
    shapes = [config for config in times_us if config is not None]
    fastest = min(shapes, key=times_us.__getitem__, default=None)
    return fastest if fastest is not None and times_us[fastest] < (1 - _MIN_GAIN) * times_us[None] else None


def _captured(run: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """run() captured in a graph, after one run outside it (which compiles and creates cuBLAS's state)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds of one replay, from CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3
