"""Disaggregated prefill, worker half: this rank's transfer region over its own KV shard, and (ZmqConnector) its
server or pull client. The engine core's connector (core/kv_transfer.py) decides which blocks go to which slots under
which nonce; every rank applies each decision to its own shard, called directly in-process or with a step message
(SchedulerOutput.kv_transfer_call) on Ray ranks. Several ranks (tp and pp) agree before answering: a load succeeds,
a slot is free and a pull has ended only where they are so on every rank."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ipc import ModelRunnerOutput, SchedulerOutput
from ipc.kv_transfer import KVTransferCall, KVTransferConfig, producer_address
from workers.distributed import parallel_state
from workers.kv_transfer import TransferRegion
from workers.kv_transfer_zmq import Answer, TransferClient, TransferServer
from workers.layers.attention import Attention

# What the engine core may ask of a rank (a Ray step message names one of these, never another attribute).
ENDPOINT_METHODS = frozenset({"num_slots", "released", "save", "load", "release", "start_pull", "poll",
                              "load_answer", "cancel", "release_remote", "wait"})


class TransferEndpoint:
    def __init__(self, config: KVTransferConfig, region: TransferRegion, rank: int = 0) -> None:
        """rank: this rank's place in its engine; ZmqConnector's rank r is served at kv_port + r (and pulls from
        the producer's rank r: both engines of a group have the same ranks)."""
        self.region = region
        zmq = config.kv_connector == "ZmqConnector"
        address = producer_address(config, rank)
        self.server = TransferServer(region, address, config.kv_hold_s) \
            if zmq and config.kv_role == "kv_producer" else None
        self.client = TransferClient(region, address, config.kv_pull_timeout_s) \
            if zmq and config.kv_role == "kv_consumer" else None
        self.pending: list[int] = []  # pulls started and not yet reported ended (the same on every rank)
        self.ended: dict[int, Answer | None] = {}  # of those, the ones ended here, with their answers
        self.answers: dict[int, Answer] = {}  # the answers of pulls the last poll() reported

    @classmethod
    def for_layers(cls, config: KVTransferConfig, layers: list[Attention], device: torch.device) -> TransferEndpoint:
        return cls(config, TransferRegion.for_layers(config, layers, device), parallel_state().rank)

    def call(self, method: str, args: list) -> Any:
        """A step message's call (ValueError for a method not in ENDPOINT_METHODS)."""
        if method not in ENDPOINT_METHODS:
            raise ValueError(f"kv_transfer_call: unknown method {method!r}; known: {sorted(ENDPOINT_METHODS)}")
        return getattr(self, method)(*args)

    def num_slots(self) -> int:
        """The slots every rank's region has (pipeline stages of unequal layers hold unequal blocks)."""
        return -_max_over_ranks([-self.region.num_slots])[0]

    def released(self, slots: list[int]) -> list[int]:
        """Those of the slots no transfer holds any more on any rank (ZmqConnector: after taking the releases of the
        transfers pulled or past their deadline since)."""
        if self.server is not None:
            self.server.take_released()
        held = _any_rank([not self.region.released(slot) for slot in slots])
        return [slot for slot, busy in zip(slots, held) if not busy]

    def save(self, block_ids: list[int], slots: list[int], nonce: int, checksum: int) -> None:
        """The blocks into the slots (and, ZmqConnector, offered to the decode engine's pull)."""
        self.region.write(block_ids, slots, nonce, checksum)
        if self.server is not None:
            self.server.offer(nonce, slots)

    def load(self, slots: list[int], block_ids: list[int], nonce: int, checksum: int, first: int) -> bool:
        """TransferRegion.read, True only where every rank's read passed its checks."""
        return not _any_rank([not self.region.read(slots, block_ids, nonce, checksum, first)])[0]

    def release(self, slots: list[int], nonce: int) -> None:
        self.region.release(slots, nonce)

    def start_pull(self, nonce: int, slots: list[int]) -> int | None:
        """A pull of the producer's slots (this rank's shard of them), not waited for; its id, or None where they
        could never fit this region."""
        pull_id = self.client.start(nonce, slots)
        if pull_id is not None:
            self.pending.append(pull_id)
        return pull_id

    def poll(self) -> list[tuple[int, bool]]:
        """The pulls that ended since, on every rank: (pull id, whether every rank's answer came); an ok answer is
        kept for load_answer() until the next poll."""
        self.answers = {}
        self.ended.update(self.client.poll())
        states = [(pull_id not in self.ended, pull_id in self.ended and self.ended[pull_id] is None)
                  for pull_id in self.pending]
        waiting, failed = _any_rank([state[0] for state in states]), _any_rank([state[1] for state in states])
        done = []
        for pull_id, still, bad in zip(list(self.pending), waiting, failed):
            if still and not bad:
                continue
            self.pending.remove(pull_id)
            self.client.cancel(pull_id)  # a failure elsewhere: this rank's answer is not wanted
            answer = self.ended.pop(pull_id, None)
            if not bad:
                self.answers[pull_id] = answer
            done.append((pull_id, not bad))
        return done

    def load_answer(self, pull_id: int, skip: int, block_ids: list[int], nonce: int, checksum: int, first: int) -> bool:
        """The reported answer's slots from `skip` on, through this region into block_ids, checked as load() checks
        them (first: the transfer's block index of the first)."""
        answer = self.answers.pop(pull_id, None)
        local = None if answer is None else self.client.load(answer, skip)
        ok = local is not None and self.region.read(local[:len(block_ids)], block_ids, nonce, checksum, first)
        return not _any_rank([not ok])[0]

    def cancel(self, pull_id: int) -> None:
        """Not wanted any more (its request aborted): an answer that still comes is dropped."""
        if pull_id in self.pending:
            self.pending.remove(pull_id)
        self.ended.pop(pull_id, None)
        self.client.cancel(pull_id)

    def release_remote(self, nonce: int, slots: list[int]) -> None:
        """The transfer not needed (the prefix cache held its blocks): the producer's slots go back now."""
        self.client.release(nonce, slots)

    def wait(self, timeout_s: float) -> None:
        if self.client is not None:
            self.client.wait(timeout_s)

    def close(self) -> None:
        for end in (self.server, self.client):
            if end is not None:
                end.close()


class StepExecutor(Protocol):
    def call_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class RemoteEndpoint:
    """The engine core's handle on Ray ranks' endpoints: each method call is one step of no tokens to every rank,
    behind the batches in flight, answered by the driver rank; the ranks' sockets close with their actors."""

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in ENDPOINT_METHODS:
            raise AttributeError(method)
        return lambda *args: self._call(KVTransferCall(method=method, args=list(args)))

    def _call(self, call: KVTransferCall) -> Any:
        return self.executor.call_step(SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                                                       num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                                       finished_req_ids=[], kv_transfer_call=call)).kv_transfer_result

    def close(self) -> None:
        """Nothing here: the actors' sockets close with them."""


def _any_rank(flags: list[bool]) -> list[bool]:
    """Each flag or'ed over the engine's ranks."""
    return [bool(value) for value in _max_over_ranks([int(flag) for flag in flags])]


def _max_over_ranks(values: list[int]) -> list[int]:
    """Each value's maximum over the engine's ranks, every stage's (each rank calls with as many values)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    reduced = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.tolist()
