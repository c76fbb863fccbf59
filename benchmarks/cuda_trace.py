"""A torch profiler chrome trace of CUDA steps read back: the GPU's busy time and the kernels that took it."""
from __future__ import annotations


def print_kernel_table(trace: dict, steps: int, top: int = 20) -> None:
    """The kernels that took the most GPU time: per step, their time and launches."""
    total: dict[str, list[float]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            entry = total.setdefault(e["name"][:90], [0.0, 0])
            entry[0] += e.get("dur", 0)
            entry[1] += 1
    print(f"{'us/step':>9} {'launches/step':>13}  kernel")
    for name, (dur, count) in sorted(total.items(), key=lambda item: -item[1][0])[:top]:
        print(f"{dur / steps:9.1f} {count / steps:13.1f}  {name}")


def gpu_busy(trace: dict) -> tuple[float, float, int]:
    """Microseconds the GPU ran a kernel, copy or memset (overlaps merged), the span from the first start to the
    last end (0 where the trace holds no GPU activity), and their count."""
    intervals = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace["traceEvents"]
                       if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X")
    if not intervals:
        return 0.0, 0.0, 0
    busy, end = 0.0, float("-inf")
    for lo, hi in intervals:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy, end - intervals[0][0], len(intervals)
