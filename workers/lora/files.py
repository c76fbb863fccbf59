"""Reading the files of a client-named adapter folder without trusting them: regular files only (a FIFO, device or
socket would block the engine loop or never end), bounded in size, under the folders the engine allows."""
from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 8 << 30


def check_under(path: str, allowed_dirs: list[str] | None) -> None:
    """ValueError unless the folder, symlinks resolved, lies under one of `allowed_dirs` (None: anywhere, for the
    engines a Python program starts for itself)."""
    if "\x00" in path:
        raise ValueError("LoRA adapter path holds a NUL character")
    if allowed_dirs is None:
        return
    folder = Path(path).resolve()
    if not any(folder.is_relative_to(Path(allowed).resolve()) for allowed in allowed_dirs):
        raise ValueError(f"LoRA adapter {path!r} is not under a folder this engine serves adapters from "
                         f"(--lora-dir or a --lora-modules folder)")


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The file's bytes; ValueError if it is not a regular file (checked on the opened file, before any read, and
    opened without blocking: a FIFO's open would wait for a writer) or is larger than `max_bytes`."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ValueError(f"cannot open {path.name}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"{path.name} is {info.st_size} bytes, over the limit of {max_bytes}")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path.name} is over the limit of {max_bytes} bytes")
    return data
