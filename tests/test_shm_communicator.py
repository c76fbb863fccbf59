"""TP collectives (no Ray) in 2 and 4 gloo ranks forked from one driver process: through shared memory, sums in rank
order, bit-identical on every rank, chunked past a slot, hundreds of rounds in a row, polling or blocking, gather
equals torch.cat, nothing left in /dev/shm; through gloo when a rank cannot map the memory; and 20 runs in a row
beside a CPU hog, every rank exiting cleanly."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forked_ranks import HOST, drive, run_driver
from workers import shm_region
from workers.distributed import (init_distributed, parallel_state, shutdown_distributed, tp_all_reduce,
                                 tp_gather_last_dim)
from workers.shm_communicator import SHM_DIR, SLOT_BYTES, connect_shm

# (shape, rounds): many tiny rounds catch slot-reuse races; the last shape spans several slots in both dtypes.
CASES = [((1, 64), 300), ((64, 256), 20), ((2 * SLOT_BYTES // 4 // 1000 + 1, 1000), 2)]
DTYPES = [torch.float32, torch.bfloat16]
GLOO_ROUNDS = 20  # at most, per case: slot reuse, which the many tiny rounds probe, is the shared memory's alone
_REPEATS_UNDER_LOAD = 20


@pytest.mark.parametrize("tp_size", [2, 4])
def test_collectives(tp_size: int, tmp_path: Path) -> None:
    _run_driver(tp_size, repeats=1, transport="shm", scratch=tmp_path, timeout=120)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_gloo_fallback_collectives(tp_size: int, tmp_path: Path) -> None:
    """The last rank cannot map the shared memory: the whole group stays on gloo, and its collectives are right."""
    _run_driver(tp_size, repeats=1, transport="gloo", scratch=tmp_path, timeout=120)


def test_collectives_repeatedly_beside_a_cpu_hog(tmp_path: Path) -> None:
    """A rank once aborted at exit under load: gloo freed a finished collective's tensors after the interpreter
    began finalizing. Every rank now shuts its groups down first; 20 runs with a busy loop on a CPU all pass."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _run_driver(2, repeats=_REPEATS_UNDER_LOAD, transport="shm", scratch=tmp_path, timeout=240)
    finally:
        hog.kill()
        hog.wait()


def _run_driver(tp_size: int, repeats: int, transport: str, scratch: Path, timeout: float) -> None:
    run_driver(__file__, [str(tp_size), str(repeats), transport, str(scratch)], timeout)
    assert not [path for path in scratch.rglob("*") if path.is_file() or path.is_fifo()]


def _rank_main(transport: str, scratch: str, rank: int, tp_size: int, port: int, run: int) -> None:
    """One rank: the checks run through the same calls the model's layers make."""
    torch.set_num_threads(1)
    threads_before = _num_threads()
    if transport == "gloo" and rank == tp_size - 1:
        shm_region.attach = lambda *args: None  # this forked rank alone: as if the mapping failed
    init_distributed(HOST, port, rank, tp_size, 0, 1, torch.device("cpu"))
    try:
        if transport == "shm":
            _check_shared_memory(tp_size, port)
        else:
            assert parallel_state().tp_comm is None, "a rank that could not map the memory should keep all on gloo"
        _check_collectives(rank, tp_size, max_rounds=GLOO_ROUNDS if transport == "gloo" else None)
        _check_fallback_when_memory_is_not_shared(rank, tp_size, Path(scratch) / f"run{run}" / f"rank{rank}")
    finally:
        shutdown_distributed()
    assert _num_threads() == threads_before, "gloo's threads should be joined before the process exits"


def _check_shared_memory(tp_size: int, port: int) -> None:
    assert parallel_state().tp_comm is not None, "ranks on one host should share memory"
    # tp=2 polls its peer on these 2 CPUs, tp=4 only blocks on its FIFO: the cases below cover both waits.
    assert (parallel_state().tp_comm.spin_ns > 0) == (len(os.sched_getaffinity(0)) >= tp_size)
    _check_mapped_and_unlinked(f"{SHM_DIR}/pagedserve-{HOST}-{port}-stage0-slots")


def _check_collectives(rank: int, tp_size: int, max_rounds: int | None) -> None:
    for dtype in DTYPES:
        for shape, rounds in CASES:
            for step in range(min(rounds, max_rounds or rounds)):
                _check_all_reduce(rank, tp_size, shape, dtype, seed=step)
                if step % 10 == 0:
                    _check_gather(rank, tp_size, shape, dtype, seed=step)


def _check_all_reduce(rank: int, tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    inputs = _inputs(tp_size, shape, dtype, seed)
    reduced = tp_all_reduce(inputs[rank].clone())
    expected = functools.reduce(torch.add, [x.float() for x in inputs]).to(dtype)  # rank order, in float32
    if parallel_state().tp_comm is not None:
        # Every rank compares bits with the same expected tensor, so the ranks agree bit for bit.
        assert torch.equal(_bits(reduced), _bits(expected)), f"rank {rank}: {dtype} {shape} all-reduce {seed} differs"
        return
    # gloo adds in an order of its own, rounding as it goes: close to the sum, and the same bits on every rank.
    bound = tp_size * torch.finfo(dtype).eps * functools.reduce(torch.add, [x.float().abs() for x in inputs])
    assert ((reduced.float() - expected.float()).abs() <= bound).all(), f"rank {rank}: {dtype} {shape} all-reduce"
    everyone = [torch.empty_like(reduced) for _ in range(tp_size)]
    dist.all_gather(everyone, reduced, group=parallel_state().tp_group)
    assert all(torch.equal(_bits(other), _bits(reduced)) for other in everyone), f"ranks disagree: {dtype} {shape}"


def _check_gather(rank: int, tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    inputs = _inputs(tp_size, shape, dtype, seed)
    gathered = tp_gather_last_dim(inputs[rank])
    if rank == 0:
        assert gathered is not None and torch.equal(_bits(gathered), _bits(torch.cat(inputs, dim=-1)))
    else:
        assert gathered is None


def _check_mapped_and_unlinked(region: str) -> None:
    """The slots live in /dev/shm and are mapped here, but their name is gone (rank 0 unlinked it)."""
    dist.barrier(group=parallel_state().tp_group)  # rank 0 may still be unlinking
    assert not os.path.exists(region)
    assert f"{region} (deleted)" in Path("/proc/self/maps").read_text()


def _check_fallback_when_memory_is_not_shared(rank: int, tp_size: int, directory: Path) -> None:
    """Each rank looks in its own directory, as ranks on different hosts would: nobody finds rank 0's files."""
    directory.mkdir(parents=True)
    group = parallel_state().tp_group
    assert connect_shm(group, rank, tp_size, "apart", directory=str(directory)) is None
    dist.barrier(group=group)


def _inputs(tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank; magnitudes spread so the order of additions shows in the bits."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 10.0 ** (rank % 3)).to(dtype) for rank in range(tp_size)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


if __name__ == "__main__":
    sys.exit(drive(int(sys.argv[1]), int(sys.argv[2]), functools.partial(_rank_main, sys.argv[3], sys.argv[4])))
