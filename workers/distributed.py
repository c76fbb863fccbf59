"""This rank's place in the tp × pp grid, its torch.distributed groups, and the collectives layers use."""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.shm_communicator import ShmCommunicator, connect_shm

if TYPE_CHECKING:
    from kernels.cpu_decoder_layer import ShmGroup
    from workers.expert_group import EngineGroup

_INIT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class ParallelState:
    """Rank r = pp_rank * tp_size + tp_rank; each pipeline stage's TP ranks form one group. On CPU its
    collectives go through shared memory (tp_comm) when the group shares this host's, else through gloo."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    tp_comm: ShmCommunicator | None = None
    expert_parallel: bool = False  # MoE layers divide whole experts among the TP ranks instead of each expert
    # With data parallel + expert parallel: the group of every engine's rank, which divides the experts instead.
    experts: EngineGroup | None = None
    # This rank and the same TP rank of the previous / next pipeline stage (pp_recv / pp_send), where there is one.
    pp_prev: dist.ProcessGroup | None = None
    pp_next: dist.ProcessGroup | None = None
    # Over pipeline stages on CPU: every rank's group in shared memory, where they all share this host's (the C++
    # multi-step calls hand hidden states and tokens over it), else None.
    world_comm: ShmCommunicator | None = None

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and replies: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0


# Set once per process by init_distributed, before the model is built; single-rank until then.
_state = ParallelState()


def parallel_state() -> ParallelState:
    return _state


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Build or run a model as if this rank were alone (a draft model that one rank holds whole)."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield
    finally:
        _state = saved


def free_port(host: str) -> int:
    """A TCP port on `host` that nothing listens on right now (for the rendezvous store)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(host: str, port: int, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                     device: torch.device, expert_parallel: bool = False) -> ParallelState:
    """Join the world (gloo on CPU, NCCL on CUDA) through the TCP store at host:port; build the TP groups."""
    global _state
    if host.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would otherwise pick the hostname's interface
    backend = "nccl" if device.type == "cuda" else "gloo"
    rank = pp_rank * tp_size + tp_rank
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=tp_size * pp_size, timeout=_INIT_TIMEOUT)
    groups = [dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size))) for stage in range(pp_size)]
    # Every rank takes part in creating every group. gloo's send/recv hands a tensor over several times slower than
    # its broadcast in a group of the two ranks.
    links = {(stage, t): dist.new_group([stage * tp_size + t, (stage + 1) * tp_size + t])
             for stage in range(pp_size - 1) for t in range(tp_size)}
    tp_comm = None
    if backend == "gloo" and tp_size > 1:  # a gloo message costs milliseconds, a shared-memory round microseconds
        tp_comm = connect_shm(groups[pp_rank], tp_rank, tp_size, f"pagedserve-{host}-{port}-stage{pp_rank}")
    world_comm = None
    if backend == "gloo" and pp_size > 1:
        world_comm = connect_shm(dist.group.WORLD, rank, tp_size * pp_size, f"pagedserve-{host}-{port}-world")
    _state = ParallelState(tp_rank, tp_size, pp_rank, pp_size, groups[pp_rank], tp_comm, expert_parallel,
                           pp_prev=links.get((pp_rank - 1, tp_rank)), pp_next=links.get((pp_rank, tp_rank)),
                           world_comm=world_comm)
    return _state


def set_expert_group(experts: EngineGroup | None) -> None:
    """This process's expert-parallel group across data-parallel engines (before the model is built), or none."""
    global _state
    _state = replace(_state, experts=experts)


def shutdown_distributed() -> None:
    """Undo init_distributed: unmap the shared memory and destroy the groups, which joins gloo's worker threads.
    A process that exits with them alive may abort ("terminate called without an active exception"): a worker
    frees the tensors of a collective that already returned only after the interpreter began finalizing, and
    the GIL it must take for that ends the thread inside a destructor."""
    global _state
    for comm in (_state.tp_comm, _state.world_comm):
        if comm is not None:
            comm.close()
    _state = ParallelState()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over this stage's TP ranks, in place."""
    if _state.tp_comm is not None:
        return _state.tp_comm.all_reduce(x)
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_kernel_group() -> ShmGroup | None:
    """This stage's TP group as the C++ layer reduces over it (its shared memory), None at one rank or over gloo."""
    return None if _state.tp_comm is None else _state.tp_comm.kernel_group


def pipeline_kernel_group() -> ShmGroup | None:
    """Every rank's group as the C++ steps hand over it between pipeline stages (its shared memory), None at one
    stage or where the ranks do not all share this host's memory."""
    return None if _state.world_comm is None else _state.world_comm.kernel_group


def ranks_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over every rank of the engine (each stage's TP ranks), in place: shared memory where they all share this
    host's, else gloo."""
    if _state.pp_size == 1:
        return tp_all_reduce(x)
    if _state.world_comm is not None:
        return _state.world_comm.all_reduce(x)
    dist.all_reduce(x)
    return x


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over this stage's TP ranks, in place (at load time: gloo or NCCL, no fast path)."""
    if _state.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_state.tp_group)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each TP rank's x along the last dimension on TP rank 0; None on the other ranks."""
    if _state.tp_size == 1:
        return x
    if _state.tp_comm is not None:
        return _state.tp_comm.gather_last_dim(x)
    x = x.contiguous()
    first = _state.pp_rank * _state.tp_size
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)] if _state.tp_rank == 0 else None
    dist.gather(x, parts, dst=first, group=_state.tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


# What a pipeline stage hands the next: [num_tokens, hidden_size] tensors, as many as the model says it needs
# (llama: hidden states and residual; OPT: hidden states alone).
Intermediate = tuple[torch.Tensor, ...]


def pp_send(intermediate: Intermediate) -> None:
    """Hand this stage's output to the same TP rank of the next stage."""
    for tensor in intermediate:
        dist.broadcast(tensor.contiguous(), _state.rank, group=_state.pp_next)


def pp_recv(num_tensors: int, num_tokens: int, hidden_size: int, dtype: torch.dtype,
            device: torch.device) -> Intermediate:
    """The previous stage's num_tensors tensors for this step's num_tokens tokens."""
    peer = _state.rank - _state.tp_size
    intermediate = tuple(torch.empty(num_tokens, hidden_size, dtype=dtype, device=device) for _ in range(num_tensors))
    for tensor in intermediate:
        dist.broadcast(tensor, peer, group=_state.pp_prev)
    return intermediate


def shard_range(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of `total` units held by tp_rank: an even split, or, with fewer units than ranks, the one
    unit this rank shares with tp_size / total others (replicated KV heads)."""
    if total % tp_size == 0:
        size = total // tp_size
        return tp_rank * size, (tp_rank + 1) * size
    if tp_size % total == 0:
        unit = tp_rank * total // tp_size
        return unit, unit + 1
    raise ValueError(f"{total} cannot be split over tensor_parallel_size={tp_size}: "
                     "one must divide the other")


def uneven_share(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of `total` units held by `rank` of `size`: contiguous, the first total % size ranks one more."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
