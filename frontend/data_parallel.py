"""Data parallel: N engine cores behind one client with EngineCoreClient's interface. Each request goes to one engine
(frontend/dp_balance.py) for its whole life, its aborts to that engine, utility calls to every engine; an engine
that dies fails its own requests at once and the others serve on."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import msgspec
import zmq

from frontend.async_core_client import AsyncEngineCoreClient
from frontend.core_client import DEFAULT_MAX_STALL_S, POLL_MS, EngineCoreClient, EngineDeadError
from frontend.dp_balance import EngineBalancer
from ipc import EngineCoreOutputs, EngineCoreRequest, RequestError, SchedulerStats, SpecDecodingStats

# How every engine's answers to a utility call make one (by default: the first engine's).
_COMBINED = {"reset_prefix_cache": all}


class DataParallelClient:
    def __init__(self, clients: list[EngineCoreClient], policy: str = "prefix") -> None:
        self.clients = clients
        # The group's: one engine's limits, all engines' KV blocks (as get_stats counts the free ones).
        self.info = msgspec.structs.replace(clients[0].info,
                                            num_kv_blocks=sum(client.info.num_kv_blocks for client in clients))
        self.balancer = EngineBalancer(len(clients), self.info.block_size, policy)
        self.pending: deque[EngineCoreOutputs] = deque()  # outputs taken from the engines' clients, in order
        self.poller = zmq.Poller()
        for client in clients:
            for sock in (client.output, *client.monitors):
                self.poller.register(sock, zmq.POLLIN)

    @property
    def live(self) -> list[tuple[int, EngineCoreClient]]:
        return [(engine, client) for engine, client in enumerate(self.clients) if self.balancer.alive[engine]]

    @property
    def dead_reason(self) -> str | None:
        """Why the group can serve nothing (every engine gone), or None."""
        if self.live:
            return None
        return "every engine core of the data-parallel group is gone: " + "; ".join(
            f"engine {engine}: {client.dead_reason}" for engine, client in enumerate(self.clients))

    def add_request(self, request: EngineCoreRequest) -> None:
        while True:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            engine = self.balancer.choose(request)
            try:
                self.clients[engine].add_request(request)
                return
            except EngineDeadError:
                self.balancer.finished(request.request_id)  # not lost with the engine: sent to another
                self._engine_died(engine)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.balancer.finished(request_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self.clients[engine].abort_requests(ids)

    def get_outputs(self) -> EngineCoreOutputs:
        """The next batch of outputs from any engine (an engine's death: errors ending each of its requests)."""
        while (batch := self._next_ready()) is None:
            ready = dict(self.poller.poll(POLL_MS))
            for engine, client in self.live:
                try:
                    if any(sock in ready for sock in (client.output, *client.monitors)):
                        client.poll(0)
                    elif not ready:
                        client._check_process()
                except EngineDeadError:
                    pass  # _next_ready ends its requests
        return batch

    def _next_ready(self) -> EngineCoreOutputs | None:
        for engine, client in self.live:
            if client.pending:
                self.pending.append(self._seen(client.pending.popleft()))
            elif client.dead_reason is not None:
                self._engine_died(engine)
        if self.pending:
            return self.pending.popleft()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        return None

    def _seen(self, batch: EngineCoreOutputs) -> EngineCoreOutputs:
        for output in batch.outputs:
            if output.finish_reason is not None:
                self.balancer.finished(output.request_id)
        for error in batch.errors:
            self.balancer.finished(error.request_id)
        return batch

    def _engine_died(self, engine: int) -> None:
        """What the engine sent before it died is delivered first; then each request it held ends with its error."""
        client = self.clients[engine]
        while client.pending:
            self.pending.append(self._seen(client.pending.popleft()))
        message = f"engine core {engine} of the data-parallel group is gone: {client.dead_reason}"
        lost = self.balancer.engine_died(engine)
        self.pending.append(EngineCoreOutputs(errors=[RequestError(request_id, message, "failed")
                                                      for request_id in lost]))

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the utility on every live engine (get_stats, reset_prefix_cache, start_profile, ...)."""
        results = [client.call_utility(method, *args) for _, client in self.live]
        return _COMBINED.get(method, _first)(results)

    def get_stats(self) -> SchedulerStats:
        return combined_stats([client.get_stats() for _, client in self.live])

    def health_problem(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> str | None:
        """Which engines are not healthy and why (see EngineCoreClient.health_problem), or None."""
        problems = [f"engine core {engine}: {problem}" for engine, client in enumerate(self.clients)
                    if (problem := client.health_problem(max_stall_s)) is not None]
        return "; ".join(problems) or None

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


class AsyncDataParallelClient(DataParallelClient):
    """The asyncio form: each engine's AsyncEngineCoreClient receives on its own task; this waits for any of them."""

    clients: list[AsyncEngineCoreClient]

    async def get_outputs_async(self) -> EngineCoreOutputs:
        while (batch := self._next_ready()) is None:
            live = [client for _, client in self.live]
            for client in live:
                client._ensure_receiver()
                client.outputs_ready.clear()
            if any(client.pending or client.dead_reason for client in live):
                continue  # arrived before the events were cleared
            waits = [asyncio.ensure_future(client.outputs_ready.wait()) for client in live]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return batch

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        results = await asyncio.gather(*(client.call_utility_async(method, *args) for _, client in self.live))
        return _COMBINED.get(method, _first)(results)

    async def get_stats_async(self) -> SchedulerStats:
        return combined_stats(list(await asyncio.gather(*(client.get_stats_async() for _, client in self.live))))

    async def check_health_async(self, max_stall_s: float = DEFAULT_MAX_STALL_S, every: bool = True) -> None:
        """EnginesDownError naming each engine that is not healthy: the group is unhealthy while any one is (or,
        with every=False, only when none is: it can still serve)."""
        down = []
        for engine, client in enumerate(self.clients):
            try:
                await client.check_health_async(max_stall_s)
            except EngineDeadError:
                down.append(engine)
        if down and (every or len(down) == len(self.clients)):
            raise EnginesDownError(self.health_problem(max_stall_s) or "engine cores down", down, len(self.clients))

    async def check_serving_async(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        await self.check_health_async(max_stall_s, every=False)


class EnginesDownError(EngineDeadError):
    """Engine cores of a data-parallel group are not healthy: which (`down`) of how many (`size`)."""

    def __init__(self, message: str, down: list[int], size: int) -> None:
        super().__init__(message)
        self.down, self.size = down, size


def _first(results: list) -> Any:
    return results[0]


def combined_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The group's stats: counts summed, usage averaged over the engines (each has as many blocks), peaks the
    highest."""
    def total(field: str) -> int:
        return sum(getattr(s, field) for s in stats)

    specs = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    spec = None
    if specs:
        width = max(len(s.drafted_per_position) for s in specs)
        spec = SpecDecodingStats(
            num_drafts=sum(s.num_drafts for s in specs), num_draft_tokens=sum(s.num_draft_tokens for s in specs),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in specs),
            drafted_per_position=[sum(s.drafted_per_position[i] for s in specs if i < len(s.drafted_per_position))
                                  for i in range(width)],
            accepted_per_position=[sum(s.accepted_per_position[i] for s in specs
                                       if i < len(s.accepted_per_position)) for i in range(width)])
    counts = ("num_running", "num_waiting", "num_free_blocks", "num_preemptions", "num_aborted_requests",
              "peak_num_running", "prefix_cache_queries", "prefix_cache_hits")
    return SchedulerStats(**{field: total(field) for field in counts},
                          kv_cache_usage=total("kv_cache_usage") / len(stats),
                          peak_kv_cache_usage=max(s.peak_kv_cache_usage for s in stats),
                          kv_utilization_at_peak=total("kv_utilization_at_peak") / len(stats), spec_decoding=spec)
