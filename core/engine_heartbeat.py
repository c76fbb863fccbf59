"""The engine core's heartbeat: twice a second, from a thread of its own (a long step cannot delay it), each client
that subscribed hears how long ago the loop last advanced and how many requests the engine holds."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.engine_clients import Peers
from ipc import EngineCoreOutputs, Heartbeat

if TYPE_CHECKING:
    from core.scheduler import Scheduler

HEARTBEAT_INTERVAL_S = 0.5


class Heart:
    """The loop writes `last_progress` and `counts`; the thread only reads them, so it never waits for the loop."""

    def __init__(self, peers: Peers, send: Callable[[bytes, EngineCoreOutputs], None],
                 held_by: Callable[[bytes], int]) -> None:
        """send: queue a message for a client; held_by: how many of that client's requests the engine holds."""
        self.peers, self.send, self.held_by = peers, send, held_by
        self.last_progress = time.monotonic()
        self.counts = (0, 0)  # (waiting, running) as the loop last published them: one tuple, replaced whole
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine-core-heartbeat", daemon=True)
        self.thread.start()

    def progressed(self, scheduler: Scheduler) -> None:
        """The loop advanced (inputs taken in, or a step done): publish the time and the scheduler's counts."""
        self.last_progress = time.monotonic()
        self.counts = (scheduler.num_waiting, len(scheduler.running))

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self.stopping.wait(HEARTBEAT_INTERVAL_S):
            loop_age = time.monotonic() - self.last_progress
            num_waiting, num_running = self.counts
            for identity in self.peers.identities():
                self.send(identity, EngineCoreOutputs(heartbeat=Heartbeat(
                    loop_age=loop_age, num_waiting=num_waiting, num_running=num_running,
                    num_yours=self.held_by(identity))))
