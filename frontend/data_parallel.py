"""Data parallel: N engine cores behind one client with EngineCoreClient's interface. Each request goes to one engine
(frontend/dp_balance.py) for its whole life, its aborts to that engine, utility calls to every engine; an engine
that dies fails its own requests at once and the others serve on."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from frontend.async_core_client import AsyncEngineCoreClient
from frontend.core_client import DEFAULT_MAX_STALL_S, POLL_MS, EngineCoreClient, EngineDeadError
from frontend.disagg_proxy import DECODE, PREFILL, DisaggProxy, is_disaggregated
from frontend.dp_balance import EngineBalancer
from frontend.dp_stats import GroupStats, group_stats
from ipc import EngineCoreOutputs, EngineCoreRequest, RequestError, SchedulerStats

# An engine's heartbeat older than this (its client has not been reading) no longer counts other front ends' load.
REPORT_TTL_S = 2.0

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
        # A kv_transfer_config group: engine 0 prefills, engine 1 decodes (frontend/disagg_proxy.py).
        self.proxy = DisaggProxy(self) if is_disaggregated([client.info for client in clients]) else None
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
        if self.proxy is not None and not self.balancer.alive[DECODE]:
            return f"the decode engine ({DECODE}) of the disaggregated group is gone: " \
                f"{self.clients[DECODE].dead_reason}"
        if self.live:
            return None
        return "every engine core of the data-parallel group is gone: " + "; ".join(
            f"engine {engine}: {client.dead_reason}" for engine, client in enumerate(self.clients))

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.proxy is not None:
            self.proxy.add_request(request)
            return
        while True:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self._take_reports()
            engine = self.balancer.choose(request)
            try:
                self.clients[engine].add_request(request)
                return
            except EngineDeadError:
                self.balancer.finished(request.request_id)  # not lost with the engine: sent to another
                self._engine_died(engine)

    def _take_reports(self) -> None:
        """Other front ends' requests on each engine, from its last heartbeat: all it holds less this client's."""
        now = time.monotonic()
        for engine, client in self.live:
            beat = client.last_report
            fresh = beat is not None and now - client.last_heartbeat[0] < REPORT_TTL_S
            self.balancer.others[engine] = max(0, beat.num_waiting + beat.num_running - beat.num_yours) if fresh else 0

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.proxy is not None:
            self.proxy.abort(request_ids)
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
        if self.proxy is not None:
            batch = self.proxy.filter(batch)
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
        if self.proxy is not None and engine == PREFILL:
            self.pending.append(self.proxy.prefill_engine_died())
            return
        self.pending.append(EngineCoreOutputs(errors=[RequestError(request_id, message, "failed")
                                                      for request_id in lost]))

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the utility on every live engine (get_stats, reset_prefix_cache, start_profile, ...)."""
        results = [client.call_utility(method, *args) for _, client in self.live]
        return _COMBINED.get(method, _first)(results)

    def get_stats(self) -> GroupStats:
        per_engine: list[SchedulerStats | None] = []
        for client, alive in zip(self.clients, self.balancer.alive):
            try:
                per_engine.append(client.get_stats() if alive else None)
            except EngineDeadError:
                per_engine.append(None)
        return self._group(per_engine)

    def _group(self, per_engine: list[SchedulerStats | None]) -> GroupStats:
        """The group's stats, and each engine's (None for one that is gone); EngineDeadError once every one is."""
        if all(stats is None for stats in per_engine):
            raise EngineDeadError(self.dead_reason or "every engine core of the data-parallel group is gone")
        return group_stats(per_engine)

    def health_problem(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> str | None:
        """Which engines are not healthy and why (see EngineCoreClient.health_problem), or None."""
        problems = [f"engine core {engine}: {problem}" for engine, client in enumerate(self.clients)
                    if (problem := client.health_problem(max_stall_s)) is not None]
        return "; ".join(problems) or None

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


class AsyncDataParallelClient(DataParallelClient):
    """The asyncio form: each engine's AsyncEngineCoreClient receives on its own task; this waits for any of them.
    Its clients subscribe to their engines' heartbeats (at the first request, wait for outputs or health check): the
    balancer weighs in other front ends' requests from them."""

    clients: list[AsyncEngineCoreClient]

    def add_request(self, request: EngineCoreRequest) -> None:
        for _, client in self.live:
            client.subscribe_heartbeats()
        super().add_request(request)

    async def get_outputs_async(self) -> EngineCoreOutputs:
        while (batch := self._next_ready()) is None:
            live = [client for _, client in self.live]
            for client in live:
                client.subscribe_heartbeats()
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

    async def get_stats_async(self) -> GroupStats:
        async def one(client: AsyncEngineCoreClient, alive: bool) -> SchedulerStats | None:
            try:
                return await client.get_stats_async() if alive else None
            except EngineDeadError:
                return None

        return self._group(list(await asyncio.gather(*map(one, self.clients, self.balancer.alive))))

    async def check_health_async(self, max_stall_s: float = DEFAULT_MAX_STALL_S, every: bool = True) -> None:
        """EnginesDownError naming each engine that is not healthy: the group is unhealthy while any one is (or,
        with every=False, only when it cannot serve: none is, or a disaggregated group's decode engine is not)."""
        down = []
        for engine, client in enumerate(self.clients):
            try:
                await client.check_health_async(max_stall_s)
            except EngineDeadError:
                down.append(engine)
        cannot_decode = self.proxy is not None and DECODE in down  # a disaggregated group serves on without prefill
        if down and (every or len(down) == len(self.clients) or cannot_decode):
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
