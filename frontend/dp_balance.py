"""Which engine core of a data-parallel group takes a request: the one whose prefix cache holds the most of its prompt
(SGLang's cache-aware routing), or the same conversation's engine, unless that engine is overloaded; else the least
loaded one."""
from __future__ import annotations

from collections import OrderedDict

from ipc import EngineCoreRequest

# Block hashes (and conversations) remembered, least recently routed forgotten first: ~100 bytes each.
MAX_REMEMBERED = 1 << 18
# A preferred engine is overloaded when it holds this many more requests than the least loaded one, and this many
# times as many (both, so a few requests' difference at low load never splits a prefix's requests).
OVERLOAD_ABSOLUTE, OVERLOAD_RELATIVE = 8, 1.5


class EngineBalancer:
    """The front end's view of each engine's load and of where each prompt prefix was sent, by chained hashes of
    the prompt's whole KV blocks (with its cache salt and adapter, which the engines' prefix caches key by too).

    An engine's load is this front end's requests in flight there, known exactly, plus the other front ends'
    requests there as the engine's last heartbeat counted them (`others`, which the client sets as they arrive)."""

    def __init__(self, num_engines: int, block_size: int, policy: str = "prefix") -> None:
        """policy: "prefix" (by prefix and conversation, then load), "load" (the least loaded) or "round_robin"
        (in turn, whatever the load: the baseline the others are measured against)."""
        self.block_size, self.policy = block_size, policy
        self.turn = 0
        self.load = [0] * num_engines  # this front end's requests in flight on each engine
        self.others = [0] * num_engines  # other front ends' requests there, as last reported
        self.alive = [True] * num_engines
        self.owner: dict[str, int] = {}  # request id → its engine, while in flight
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # block-chain hash → the engine it was sent to
        self.blocks_sent = [0] * num_engines  # of `prefixes`, those on each engine
        self.sessions: OrderedDict[str, int] = OrderedDict()  # cache_salt → the engine its conversation uses
        self.prefix_routed = self.load_routed = 0  # requests sent for their prefix / conversation, and by load

    def choose(self, request: EngineCoreRequest) -> int:
        """The engine for `request` (recorded as in flight there until finished())."""
        hashes = self._block_hashes(request) if self.policy == "prefix" else []
        preferred = self.sessions.get(request.cache_salt) if self.policy == "prefix" and request.cache_salt else None
        if preferred is None or not self.alive[preferred]:
            preferred = self._deepest_match(hashes)
        if self.policy == "round_robin":
            engine = self._next_in_turn()
            self.load_routed += 1
        elif preferred is not None and not self.overloaded(preferred):
            engine = preferred
            self.prefix_routed += 1
        else:
            engine = self._least_loaded()
            self.load_routed += 1
        self._remember(hashes, request.cache_salt, engine)
        self.assign(request.request_id, engine)
        return engine

    def assign(self, request_id: str, engine: int) -> None:
        """The request is in flight on `engine` until finished()."""
        self.owner[request_id] = engine
        self.load[engine] += 1

    def finished(self, request_id: str) -> int | None:
        """The request ended (its final output or error): its engine, no longer loaded by it."""
        engine = self.owner.pop(request_id, None)
        if engine is not None:
            self.load[engine] -= 1
        return engine

    def engine_died(self, engine: int) -> list[str]:
        """The engine is gone: it takes no more requests; the ids of those it held."""
        self.alive[engine] = False
        lost = [request_id for request_id, owner in self.owner.items() if owner == engine]
        for request_id in lost:
            self.finished(request_id)
        return lost

    def _block_hashes(self, request: EngineCoreRequest) -> list[int]:
        ids, size = request.prompt_token_ids, self.block_size
        chained = hash((request.cache_salt, request.lora_request.lora_name if request.lora_request else None))
        hashes = []
        for start in range(0, len(ids) - size + 1, size):
            chained = hash((chained, *ids[start:start + size]))
            hashes.append(chained)
        return hashes

    def _deepest_match(self, hashes: list[int]) -> int | None:
        """The live engine the longest run of these blocks was sent to (a chain: the first miss ends it)."""
        engine = None
        for block_hash in hashes:
            owner = self.prefixes.get(block_hash)
            if owner is None or not self.alive[owner]:
                break
            engine = owner
        return engine

    def weight(self, engine: int) -> int:
        """The requests the engine holds, as far as this front end knows."""
        return self.load[engine] + self.others[engine]

    def overloaded(self, engine: int) -> bool:
        load, lightest = self.weight(engine), min(self.weight(live) for live in self._live())
        return load - lightest > OVERLOAD_ABSOLUTE and load > OVERLOAD_RELATIVE * lightest

    def _live(self) -> list[int]:
        live = [engine for engine, alive in enumerate(self.alive) if alive]
        if not live:
            raise RuntimeError("every engine core of the data-parallel group is gone")
        return live

    def _next_in_turn(self) -> int:
        live = self._live()
        self.turn += 1
        return live[self.turn % len(live)]

    def _least_loaded(self) -> int:
        """The live engine holding the fewest requests; among equals, the one this front end has sent the
        fewest remembered blocks (so new prefixes spread over the engines' caches even when nothing is running)."""
        return min(self._live(), key=lambda engine: (self.weight(engine), self.blocks_sent[engine]))

    def _remember(self, hashes: list[int], session: str | None, engine: int) -> None:
        for block_hash in hashes:
            before = self.prefixes.pop(block_hash, None)
            if before is not None:
                self.blocks_sent[before] -= 1
            self.prefixes[block_hash] = engine
            self.blocks_sent[engine] += 1
        while len(self.prefixes) > MAX_REMEMBERED:
            self.blocks_sent[self.prefixes.popitem(last=False)[1]] -= 1
        if session is not None and self.policy == "prefix":
            self.sessions[session] = engine
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_REMEMBERED:
                self.sessions.popitem(last=False)
