"""The torch profiler behind the start_profile/stop_profile utility calls of an engine core, bounded in time
and steps."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch


class EngineProfiler:
    """Records into the one directory fixed at start-up; stops by itself (writing its trace) at either bound."""

    def __init__(self, trace_dir: str, max_seconds: float, max_steps: int) -> None:
        self.trace_dir, self.max_seconds, self.max_steps = Path(trace_dir), max_seconds, max_steps
        self._profile: torch.profiler.profile | None = None
        self._started_at = 0.0
        self._steps = 0
        self._written: str | None = None  # the trace of a profile that stopped itself, until stop() reports it

    def start(self) -> str:
        """Start recording; returns the directory the trace will go to."""
        if self._profile is not None:
            raise RuntimeError("the profiler is already running")
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._started_at, self._steps, self._written = time.monotonic(), 0, None
        return str(self.trace_dir)

    def on_step(self) -> None:
        """Count an engine step; past either bound, stop and write the trace."""
        if self._profile is None:
            return
        self._steps += 1
        if self._steps >= self.max_steps or time.monotonic() - self._started_at >= self.max_seconds:
            self._written = self._write()

    def stop(self) -> str:
        """Stop recording and write a Chrome trace; returns its path (also for a profile that stopped itself)."""
        if self._profile is not None:
            return self._write()
        if self._written is not None:
            written, self._written = self._written, None
            return written
        raise RuntimeError("the profiler is not running (call start_profile first)")

    def _write(self) -> str:
        profile, self._profile = self._profile, None
        profile.stop()
        path = self.trace_dir / f"pagedserve-engine-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        profile.export_chrome_trace(str(path))
        return str(path)
