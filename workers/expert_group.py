"""Expert parallel across data-parallel engines: the gloo groups spanning the engines, the MoE layers' token exchange
over the group of every engine's ranks, and the waves' per-step flag exchange (core/waves.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

_JOIN_TIMEOUT = timedelta(minutes=5)
# How long a collective waits for an engine that is alive but does not join it (one that died breaks the
# connection, which ends the collective at once): longer than the slowest step of any engine.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_EP_TIMEOUT_S", "300"))


class EngineGroupLost(RuntimeError):
    """A collective of the group failed: an engine died, stopped or hung. The experts it held are gone with it, so
    no engine of the group can serve alone."""


@dataclass(frozen=True)
class EngineGroup:
    """A gloo group spanning the data-parallel engines (of their processes, or of all their ranks)."""

    rank: int
    size: int
    group: dist.ProcessGroup
    store: dist.Store | None  # the rendezvous store, kept alive with the group

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        _wait(self.group.allgather([parts], [tensor]))
        return parts

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        _wait(self.group.allreduce([tensor], options))
        return tensor


def _wait(work: dist.Work) -> None:
    try:
        work.wait()
    except RuntimeError as error:
        raise EngineGroupLost("an engine of the data-parallel group left the expert-parallel group (it died, "
                              "stopped, or did not answer within PAGEDSERVE_EP_TIMEOUT_S); the experts it held are "
                              f"gone, so this engine cannot serve alone: {error}") from error


def join_group(address: str, name: str, rank: int, size: int, serve: bool = False) -> EngineGroup:
    """The gloo group `name` of `size` ranks, meeting at address (host:port), where the process that passes serve=True
    (data-parallel engine 0) listens: apart from any tensor-parallel world this process belongs to. Two groups use
    it: "waves", of the engine processes, and "experts", of every engine's ranks."""
    host, _, port = address.rpartition(":")
    if host.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would otherwise pick the hostname's interface
    store = dist.TCPStore(host, int(port), is_master=serve, wait_for_workers=False, timeout=_JOIN_TIMEOUT)
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return EngineGroup(rank, size, group, store)


Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def exchange_tokens(group: EngineGroup, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    compute: Experts) -> torch.Tensor:
    """This rank's rows of sum over ranks of compute(every rank's x, weights, ids): each rank's local experts applied
    to the group's tokens, then summed. Token counts differ per engine, so they are exchanged first and the tokens
    padded to the largest; x, routing weights and expert ids travel in one float32 tensor (ids < 2^24 are exact)."""
    count = torch.tensor([x.shape[0]], dtype=torch.int64)
    counts = [int(part) for part in group.all_gather(count)]
    total = sum(counts)
    if total == 0:  # every engine ran a dummy pass
        return x
    hidden, top_k = x.shape[1], ids.shape[1]
    packed = torch.zeros(max(counts), hidden + 2 * top_k, dtype=torch.float32)
    packed[:x.shape[0]] = torch.cat([x.float(), weights.float(), ids.float()], dim=1).cpu()  # gloo: host memory
    rows = torch.cat([part[:n] for part, n in zip(group.all_gather(packed), counts)]).to(x.device)
    out = compute(rows[:, :hidden].to(x.dtype), rows[:, hidden:hidden + top_k],
                  rows[:, hidden + top_k:].to(torch.int64))
    out = group.all_reduce(out.cpu())
    start = sum(counts[:group.rank])
    return out[start:start + x.shape[0]].to(x.device)


def any_work(group: EngineGroup, has_work: bool, steps: int) -> bool:
    """Whether any engine has work for the next step. Every engine calls it as often as the others; the step
    counts they give must agree, or the engines' collectives have fallen out of step (RuntimeError)."""
    flags = group.all_reduce(torch.tensor([int(has_work), steps, -steps], dtype=torch.int64), dist.ReduceOp.MAX)
    if int(flags[1]) != -int(flags[2]):
        raise RuntimeError(f"the data-parallel engines are out of step: step counts from {-int(flags[2])} to "
                           f"{int(flags[1])} (this engine: {steps})")
    return bool(flags[0])
