"""The messages between the engine core and its grammar-compile worker processes, and their framing on a pipe."""
from __future__ import annotations

import struct
from typing import BinaryIO, Literal

import msgspec

from ipc.structured_outputs import StructuredOutputsParams

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = (1 << 32) - 1


class CompileJob(msgspec.Struct, kw_only=True):
    job_id: int
    params: StructuredOutputsParams


class CompileResult(msgspec.Struct, kw_only=True):
    """A compiled constraint as the engine rebuilds it (`backend`, `payload`: xgrammar's serialized grammar; nothing
    for llguidance, whose matcher is cheap to build again), or the constraint's own error (`error`)."""

    job_id: int
    backend: Literal["xgrammar", "guidance", ""] = ""
    payload: bytes = b""
    error: str | None = None
    engine_fault: bool = False  # the error is a backend's bug (HTTP 500), not the constraint's fault (400)
    worker_exits: bool = False  # the worker exits after this reply (it ran out of memory); the next one is fresh


class WorkerReady(msgspec.Struct, kw_only=True):
    """Sent once by a worker whose vocabulary tables are built (or `error`: they could not be)."""

    error: str | None = None


def write_frame(stream: BinaryIO, message: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(message)
    stream.write(_LENGTH.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's body, or None at the end of the stream (the other side exited)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    body = stream.read(length)
    return body if len(body) == length else None
