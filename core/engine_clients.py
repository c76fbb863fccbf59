"""What the engine-core process knows of its clients: who gets heartbeats, who promised to say it lives, and
rate-limited warnings about each one's malformed messages."""
from __future__ import annotations

import collections
import logging
import threading
import time

logger = logging.getLogger("pagedserve.engine_core")
_WARNING_INTERVAL_S = 10.0  # at most one malformed-message warning per client this often; the rest are counted
_MAX_PEERS = 4096  # clients heartbeats go to, the latest subscribers (gone ones are never announced)


class Peers:
    """The clients that subscribed to heartbeats, at most _MAX_PEERS, forgetting the earliest first: a client that
    goes away is never announced, and heartbeats to every subscriber ever would grow without end."""

    def __init__(self) -> None:
        self._last_heard: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def heard_from(self, identity: bytes) -> None:
        self._last_heard[identity] = None
        self._last_heard.move_to_end(identity)
        if len(self._last_heard) > _MAX_PEERS:
            self._last_heard.popitem(last=False)

    def identities(self) -> list[bytes]:
        return list(self._last_heard)  # a copy: the reader thread adds while the heartbeat thread sends


class LivingClients:
    """When each client that sends ClientAlive messages last did (the reader thread writes, the heartbeat thread
    reads: hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_heard: dict[bytes, float] = {}

    def heard_from(self, identity: bytes) -> None:
        with self._lock:
            self._last_heard[identity] = time.monotonic()

    def gone(self, silent_since: float) -> list[bytes]:
        """The clients not heard from since `silent_since`, forgotten from now on."""
        with self._lock:
            silent = [identity for identity, heard in self._last_heard.items() if heard < silent_since]
            for identity in silent:
                del self._last_heard[identity]
        return silent


class RateLimitedWarnings:
    """One warning per client per interval for malformed messages, with a count of those not logged since."""

    def __init__(self) -> None:
        self.last_logged: dict[bytes, float] = {}
        self.suppressed: dict[bytes, int] = {}

    def warn(self, identity: bytes, error: Exception) -> None:
        now = time.monotonic()
        if now - self.last_logged.get(identity, -_WARNING_INTERVAL_S) < _WARNING_INTERVAL_S:
            self.suppressed[identity] = self.suppressed.get(identity, 0) + 1
            return
        self.last_logged[identity] = now
        skipped = self.suppressed.pop(identity, 0)
        logger.warning("malformed message from client %s: %s%s", identity.hex(), error,
                       f" ({skipped} more since the last warning)" if skipped else "")
