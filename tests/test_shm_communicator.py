"""Shared-memory TP collectives (no Ray): 2 and 4 spawned gloo ranks; sums in rank order, bit-identical on every
rank, chunked past a slot, hundreds of rounds in a row, polling or blocking; gather equals torch.cat; nothing left
in /dev/shm."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.distributed import free_port, init_distributed, parallel_state, tp_all_reduce, tp_gather_last_dim
from workers.shm_communicator import SHM_DIR, SLOT_BYTES, connect_shm

# (shape, rounds): many tiny rounds catch slot-reuse races; the last shape spans several slots in both dtypes.
CASES = [((1, 64), 300), ((64, 256), 20), ((2 * SLOT_BYTES // 4 // 1000 + 1, 1000), 2)]
DTYPES = [torch.float32, torch.bfloat16]
HOST = "127.0.0.1"
_TIMEOUT_S = 120
_REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_collectives(tp_size: int, tmp_path: Path) -> None:
    port = free_port(HOST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), str(tp_size), str(port), str(tmp_path)], env=env)
             for rank in range(tp_size)]
    try:
        exit_codes = [process.wait(timeout=_TIMEOUT_S) for process in ranks]
    finally:
        for process in ranks:
            process.kill()  # a no-op for ranks that exited; frees the others from a FIFO read with a dead peer
            process.wait()
    assert exit_codes == [0] * tp_size  # a rank's assertion error is in its stderr
    assert not [path for path in os.listdir(SHM_DIR) if path.startswith(f"pagedserve-{HOST}-{port}-")]
    assert not [path for path in tmp_path.rglob("*") if path.is_file() or path.is_fifo()]


def _rank_main(rank: int, tp_size: int, port: int, scratch: str) -> None:
    """One rank: the checks run through the same calls the model's layers make."""
    torch.set_num_threads(1)
    state = init_distributed(HOST, port, rank, tp_size, 0, 1, torch.device("cpu"))
    assert state.tp_comm is not None, "ranks on one host should share memory"
    # tp=2 polls its peer on these 2 CPUs, tp=4 only blocks on its FIFO: the cases below cover both waits.
    assert (state.tp_comm.spin_ns > 0) == (len(os.sched_getaffinity(0)) >= tp_size)
    _check_mapped_and_unlinked(f"{SHM_DIR}/pagedserve-{HOST}-{port}-stage0-slots")
    for dtype in DTYPES:
        for shape, rounds in CASES:
            for step in range(rounds):
                _check_all_reduce(rank, tp_size, shape, dtype, seed=step)
                if step % 10 == 0:
                    _check_gather(rank, tp_size, shape, dtype, seed=step)
    _check_fallback_when_memory_is_not_shared(rank, tp_size, Path(scratch) / f"rank{rank}")


def _check_all_reduce(rank: int, tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    inputs = _inputs(tp_size, shape, dtype, seed)
    reduced = tp_all_reduce(inputs[rank].clone())
    expected = functools.reduce(torch.add, [x.float() for x in inputs]).to(dtype)  # rank order, in float32
    # Every rank compares bits with the same expected tensor, so the ranks agree bit for bit.
    assert torch.equal(_bits(reduced), _bits(expected)), f"rank {rank}: {dtype} {shape} all-reduce {seed} differs"


def _check_gather(rank: int, tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    inputs = _inputs(tp_size, shape, dtype, seed)
    gathered = tp_gather_last_dim(inputs[rank])
    if rank == 0:
        assert gathered is not None and torch.equal(_bits(gathered), _bits(torch.cat(inputs, dim=-1)))
    else:
        assert gathered is None


def _check_mapped_and_unlinked(region: str) -> None:
    """The slots live in /dev/shm and are mapped here, but their name is gone (rank 0 unlinked it)."""
    torch.distributed.barrier(group=parallel_state().tp_group)  # rank 0 may still be unlinking
    assert not os.path.exists(region)
    assert f"{region} (deleted)" in Path("/proc/self/maps").read_text()


def _check_fallback_when_memory_is_not_shared(rank: int, tp_size: int, directory: Path) -> None:
    """Each rank looks in its own directory, as ranks on different hosts would: nobody finds rank 0's files."""
    directory.mkdir()
    group = parallel_state().tp_group
    assert connect_shm(group, rank, tp_size, "apart", directory=str(directory)) is None
    torch.distributed.barrier(group=group)


def _inputs(tp_size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank; magnitudes spread so the order of additions shows in the bits."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 10.0 ** (rank % 3)).to(dtype) for rank in range(tp_size)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


if __name__ == "__main__":
    _rank_main(*map(int, sys.argv[1:4]), sys.argv[4])
