"""The two sides that `serve.py --compare-offline` compares: offline `LLM.generate` and a launched server.

Both run this checkout (not whichever pagedserve is installed) with the same engine settings; neither computes
in the calling process: `LLM` starts its own engine-core process and the server is `python -m launch`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402

HEALTH_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags both sides get, named as `LLM`'s keyword arguments."""
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int

    def launcher_flags(self) -> list[str]:
        return [item for name, value in dataclasses.asdict(self).items()
                for item in (f"--{name.replace('_', '-')}", str(value))]


def model_folder(path: str | None) -> str:
    """`path`, or the benchmark model's folder (the model maker's random ~30M llama, made first if needed)."""
    return path or str(ensure_benchmark_model())


def model_vocab(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


class OfflineEngine:
    """One `LLM` kept up across runs, so every timed run meets a warm engine as the launched server does; shut
    down on leaving its `with` block."""

    def __init__(self, model: str, settings: EngineSettings) -> None:
        self.llm = LLM(model, **dataclasses.asdict(settings))

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.llm.shutdown()

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
        """Greedy `LLM.generate` of every prompt to exactly its output length (ignore_eos); the generate call's
        duration and throughput."""
        inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        duration = time.perf_counter() - start
        generated = sum(len(output.outputs[0].token_ids) for output in outputs)
        if generated != sum(output_lens):
            raise RuntimeError(f"offline generate made {generated} tokens, not the {sum(output_lens)} asked for")
        return {"duration_s": duration, "completed": len(outputs), "total_output_tokens": generated,
                "request_throughput": len(outputs) / duration, "output_token_throughput": generated / duration}


@dataclass
class Server:
    """A launcher subprocess; `exit_code` is set once it is stopped."""
    base_url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    exit_code: int | None = None

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launcher exited ({self.process.returncode}) before it was healthy "
                                   "(stop() shows its log)")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"the launcher was not healthy within {HEALTH_TIMEOUT_S:.0f} s; its log ends:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.exit_code = self.process.returncode
        if self.exit_code != 0:
            print(f"the launcher exited with {self.exit_code}; its log ends:\n{self.log_tail()}", file=sys.stderr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(model: str, settings: EngineSettings) -> Iterator[Server]:
    """`python -m launch` for `model` on a free loopback port, healthy on entry, stopped with SIGTERM on exit
    (its output goes to a temporary log, shown when it fails)."""
    port = free_port()
    command = [sys.executable, "-m", "launch", "--model", model, "--port", str(port), *settings.launcher_flags()]
    with tempfile.TemporaryFile() as log:
        server = Server(f"http://127.0.0.1:{port}", subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                                                     stderr=subprocess.STDOUT), log)
        try:
            server.wait_healthy()
            yield server
        finally:
            server.stop()
