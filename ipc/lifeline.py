"""A lifeline pipe: a child process learns that the process that started it is gone, even after kill -9.

The parent keeps the write end open and never writes; the child blocks reading the other end and sees EOF
when the parent exits for any reason (the kernel closes its descriptors).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable


def make_lifeline() -> tuple[int, int]:
    """(child's read end, to pass with pass_fds; parent's write end, to keep open)."""
    return os.pipe()


def watch_lifeline(fd: int, on_parent_exit: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while pipe.read(1):
                pass
        on_parent_exit()

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
