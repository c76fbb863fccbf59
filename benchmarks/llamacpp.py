"""llama.cpp's llama-server as a peer in the benchmarks: started on a free loopback port, driven over HTTP."""
from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import serve_compare


@contextlib.contextmanager
def llamacpp_server(server: str, gguf: str, slots: int, slot_tokens: int) -> Iterator[str]:
    """llama-server's base URL while the block runs: `slots` slots of `slot_tokens` context each (continuous
    batching across them), 2 threads for generation and for prompts."""
    port = serve_compare.free_port()
    process = subprocess.Popen([server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
                                "-np", str(slots), "-c", str(slots * slot_tokens), "--no-webui"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/health", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def complete(base_url: str, prompt: list[int], max_tokens: int, sampling: dict | None = None) -> int:
    """One non-streamed /completion of exactly max_tokens tokens (no prompt cache), greedy unless `sampling` gives
    its options (temperature, top_k, top_p, min_p); the tokens it made."""
    body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
                       **(sampling or {"temperature": 0.0})}).encode()
    request = urllib.request.Request(f"{base_url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["timings"]["predicted_n"]


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("llama-server did not become ready")
