"""The CPUs this process may use: its affinity mask and its cgroup's CPU quota, read afresh on every call."""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus() -> int:
    """CPUs in this thread's affinity mask, fewer where a cgroup quota allows less: its whole CPUs (a 1.5-CPU quota
    gives 1; a second thread would be throttled in the middle of its barriers), never below 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.floor(quota) if quota is not None else cpus))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """The tightest CPU quota (in CPUs) of this process's cgroup and its ancestors, cgroup v2 (cpu.max) or v1
    (cpu.cfs_quota_us over cpu.cfs_period_us); None where there is none or it cannot be read."""
    try:
        membership = Path("/proc/self/cgroup").read_text() if membership is None else membership
    except OSError:
        return None
    quotas = []
    for line in membership.splitlines():
        hierarchy, _, path = line.partition(":")[2].partition(":")
        if hierarchy == "":
            quotas += [_v2_quota(folder) for folder in _folders(root, path)]
        elif "cpu" in hierarchy.split(","):
            quotas += [_v1_quota(folder) for folder in _folders(root / hierarchy, path)]
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its ancestors' up to the mount (in a container the path may name the host's view,
    in which case only the mount itself, the container's own cgroup, exists)."""
    folder = mount / path.strip("/")
    return [folder, *folder.parents[:len(folder.relative_to(mount).parts)]]


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None

