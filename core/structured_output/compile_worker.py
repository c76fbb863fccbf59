"""A grammar-compile worker process: compiles the constraints the engine core sends on stdin, one at a time, and
sends each result back on stdout. It runs at idle CPU priority under a memory limit, and the engine kills it when
nobody waits for its compile any more: the only way to stop xgrammar, whose compiles cannot be interrupted.

Run by core/structured_output/compile_pool.py as `python -m core.structured_output.compile_worker ...`.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import sys
from typing import TYPE_CHECKING

import msgspec

from ipc.grammar_compile import CompileJob, CompileResult, WorkerReady, read_frame, write_frame

if TYPE_CHECKING:
    from core.structured_output.backends import Backends

_OUT_OF_MEMORY = ("bad_alloc", "memory")
_PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.structured_output.compile_worker", description=__doc__)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--memory-mb", type=int, required=True,
                        help="address space it may add once its tables are built")
    parser.add_argument("--parent-pid", type=int, required=True, help="the engine process that started it")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)  # before the imports below, which take seconds
    # Frames go to the engine on the original stdout; whatever a library prints goes to stderr instead.
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    frames_in = sys.stdin.buffer
    from core.structured_output.backends import Backends  # noqa: F811 (xgrammar and transformers load here, late)

    backends = Backends(args.tokenizer_dir, args.vocab_size)
    try:
        backends.build_tables()
    except Exception as error:  # each job then fails with the reason, as an in-process compile would
        write_frame(frames_out, WorkerReady(error=f"the vocabulary tables could not be built: {error}"))
        return 1
    _limit_memory(args.memory_mb)
    write_frame(frames_out, WorkerReady())
    decoder = msgspec.msgpack.Decoder(CompileJob)
    while (body := read_frame(frames_in)) is not None:
        job = decoder.decode(body)
        result = _compile(backends, job, args.memory_mb)
        write_frame(frames_out, result)
        if result.worker_exits:  # after a failed allocation the libraries' state is not to be trusted: a fresh worker
            return 1
    return 0


def _compile(backends: Backends, job: CompileJob, memory_mb: int) -> CompileResult:
    try:
        backend, payload = backends.export(backends.compile(job.params))
        return CompileResult(job_id=job.job_id, backend=backend, payload=payload)
    except ValueError as error:
        if not any(word in str(error) for word in _OUT_OF_MEMORY):
            return CompileResult(job_id=job.job_id, error=str(error))
    except MemoryError:
        pass
    except Exception as error:  # a backend's bug on this constraint: reported as the engine's fault
        return CompileResult(job_id=job.job_id, error=f"{type(error).__name__}: {error}", engine_fault=True)
    return CompileResult(job_id=job.job_id, worker_exits=True, error=f"structured_outputs.{job.params.kind} needs "
                         f"more than {memory_mb} MiB to compile (--structured-outputs-compile-memory-mb)")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when the engine thread that started it ends, however it ends. No thread
    of ours could notice: a compile holds the interpreter for as long as it runs."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the engine's shutdown kills its workers
        return
    if os.getppid() != parent_pid:  # it ended before the line above
        os._exit(1)


def _limit_memory(memory_mb: int) -> None:
    """Address space beyond what the process already maps: a compile past it fails to allocate, not the machine."""
    with open("/proc/self/status") as status:
        mapped_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = mapped_kb * 1024 + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    sys.exit(main())
