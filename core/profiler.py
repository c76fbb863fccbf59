"""The torch profiler behind the start_profile/stop_profile utility calls of an engine core."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch


class EngineProfiler:
    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._trace_dir: Path | None = None

    def start(self, trace_dir: str | None = None) -> str:
        """Start recording; the trace will go to trace_dir, $PAGEDSERVE_TORCH_PROFILER_DIR or the temp dir."""
        if self._profile is not None:
            raise RuntimeError("the profiler is already running")
        self._trace_dir = Path(trace_dir or os.environ.get("PAGEDSERVE_TORCH_PROFILER_DIR") or tempfile.gettempdir())
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        return str(self._trace_dir)

    def stop(self) -> str:
        """Stop recording and write a Chrome trace; returns its path."""
        if self._profile is None:
            raise RuntimeError("the profiler is not running (call start_profile first)")
        profile, self._profile = self._profile, None
        profile.stop()
        path = self._trace_dir / f"pagedserve-engine-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        profile.export_chrome_trace(str(path))
        return str(path)
