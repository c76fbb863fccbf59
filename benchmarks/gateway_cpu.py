"""Gateway CPU per streamed token: the real gateway of one or more source trees, against a stand-in engine.

Method. A stand-in engine core (this file run with --stand-in-engine, a process of its own that imports only ipc:
no torch, no model) binds the engine endpoints as core/engine_process.py does, answers the handshake (get_info),
get_stats, check_health and heartbeat subscriptions, and every 100 ms gives every live request one new token (ids
of ordinary words from the model's vocabulary) until it has max_tokens, the last with finish_reason "length"; an
abort ends a request with "abort". The real gateway (`python -m frontend.api.server`, run with cwd and PYTHONPATH
set to each --tree) attaches to it, and the real benchmark client (serve.py's run_benchmark, in this process) sends
--streams streaming /v1/completions requests of --input-len random prompt token ids and --tokens max_tokens
(ignore_eos), all at once. The gateway's CPU time (psutil user + system, all its threads) over that streaming phase,
divided by the tokens streamed, is its µs per token; the client's own CPU is shown the same way.

Rounds. Each of --rounds rounds runs every tree once, in the order given (old, new, old, new, ...), each time on
a fresh gateway process that first streams one untimed warm-up round (--streams × min(--tokens, 16)), so no tree
inherits another's warm caches and drift in the host's speed spreads over both. One stand-in engine serves all.

Target: the gateway's median ≤ 40 µs per token on this 2-core host (past measurements: ~35-39 µs) at the defaults,
200 streams × 128 tokens. psutil counts CPU in 10 ms ticks and each request has fixed costs (HTTP, tokenizing),
so a tiny run (20 × 16 tokens: steps of ~31 µs) says only that everything works. Needs psutil. Example:
    git clone -q /work/main /tmp/old && python benchmarks/gateway_cpu.py --tree /tmp/old --tree /work/main
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import zmq

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from ipc import (  # noqa: E402
    AbortRequests, Decoder, Encoder, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
    EngineInfo, FinishReason, Heartbeat, SchedulerStats, SubscribeHeartbeats, UtilityCall, UtilityResult)
from ipc.sockets import EngineEndpoints, bind_router, private_ipc_address, remove_ipc_files  # noqa: E402

STEP_S = 0.1  # one token per live request per step
HEARTBEAT_S = 0.5  # as the real engine core
WARM_UP_TOKENS = 16
TARGET_US = 40.0
DEFAULT_MODEL = Path.home() / ".cache" / "pagedserve" / "test-models" / "llama-tiny"  # tests' tiny_model("llama")
START_TIMEOUT_S = 180.0  # the gateway imports transformers (and the old one torch) on a busy 2-core host


# -- the stand-in engine core ---------------------------------------------------------------------------------------
def word_token_ids(model: str) -> list[int]:
    """Ids of tokens that are ordinary words (byte-level 'Ġword' or sentencepiece '▁word'), so the gateway's
    detokenizer does the usual work; ids 100..399 when the vocabulary is not a plain dict."""
    vocab = json.loads((Path(model) / "tokenizer.json").read_text())["model"].get("vocab")
    ids = sorted(i for token, i in vocab.items() if re.fullmatch(r"[Ġ▁][A-Za-z]+", token)) \
        if isinstance(vocab, dict) else []
    return ids if len(ids) >= 16 else list(range(100, 400))


class StandInEngine:
    def __init__(self, address: str, model: str, max_model_len: int) -> None:
        self.endpoints = EngineEndpoints.from_address(address)
        self.context = zmq.Context()
        self.inbox = bind_router(self.context, self.endpoints.input, None)
        self.outbox = bind_router(self.context, self.endpoints.output, None)
        self.encoder, self.decoder = Encoder(), Decoder(EngineCoreInput)
        config = json.loads((Path(model) / "config.json").read_text())
        self.info = EngineInfo(model=model, max_model_len=max_model_len, vocab_size=config["vocab_size"],
                               num_kv_blocks=1 << 16, block_size=16, scheduling_policy="fcfs")
        self.token_ids = word_token_ids(model)
        self.live: dict[bytes, dict[str, list[int]]] = {}  # client → request id → [given, max_tokens, offset]
        self.peers: set[bytes] = set()
        self.added = 0

    def run(self) -> None:
        parent = os.getppid()
        next_step = next_beat = time.monotonic()
        while os.getppid() == parent:  # the benchmark is gone: so is its engine
            timeout_ms = max(0.0, min(next_step, next_beat) - time.monotonic()) * 1000
            while self.inbox.poll(timeout_ms):
                identity, *frames = self.inbox.recv_multipart()
                try:
                    self.handle(identity, self.decoder.decode(frames))
                except Exception as error:  # a message this stand-in cannot read must not end the benchmark
                    print(f"stand-in engine: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                timeout_ms = 0
            now = time.monotonic()
            if now >= next_step:
                self.step()
                next_step = max(next_step + STEP_S, now)
            if now >= next_beat:
                for identity in self.peers:
                    self.send(identity, EngineCoreOutputs(heartbeat=Heartbeat(loop_age=0.0)))
                next_beat = now + HEARTBEAT_S

    def handle(self, identity: bytes, message: object) -> None:
        requests = self.live.setdefault(identity, {})
        if isinstance(message, EngineCoreRequest):
            limit = message.sampling_params.max_tokens or self.info.max_model_len - len(message.prompt_token_ids)
            requests[message.request_id] = [0, limit, self.added]
            self.added += 1
        elif isinstance(message, AbortRequests):
            aborted = [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT)
                       for r in message.request_ids if requests.pop(r, None) is not None]
            if aborted:
                self.send(identity, EngineCoreOutputs(outputs=aborted, timestamp=time.time()))
        elif isinstance(message, UtilityCall):
            self.send(identity, EngineCoreOutputs(utility_result=self.utility(message)))
        elif isinstance(message, SubscribeHeartbeats):
            self.peers.add(identity)

    def utility(self, call: UtilityCall) -> UtilityResult:
        running = sum(map(len, self.live.values()))
        results = {"get_info": self.info, "check_health": True,
                   "get_stats": SchedulerStats(num_running=running, num_waiting=0, kv_cache_usage=0.0,
                                               num_free_blocks=self.info.num_kv_blocks, num_preemptions=0)}
        if call.method not in results:
            return UtilityResult(call.call_id, error=f"the stand-in engine has no utility {call.method!r}")
        return UtilityResult(call.call_id, result=results[call.method])

    def step(self) -> None:
        ids = self.token_ids
        for identity, requests in self.live.items():
            outputs = []
            for request_id, state in list(requests.items()):
                state[0] += 1
                done = state[0] >= state[1]
                token = ids[(state[0] + state[2]) % len(ids)]
                outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[token],
                                                finish_reason=FinishReason.LENGTH if done else None))
                if done:
                    del requests[request_id]
            if outputs:
                self.send(identity, EngineCoreOutputs(outputs=outputs, timestamp=time.time()))

    def send(self, identity: bytes, message: EngineCoreOutputs) -> None:
        self.outbox.send_multipart([identity, *self.encoder.encode(message)], copy=False)


# -- the gateways and the client ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tree_env(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": tree}


def check_tree(tree: str) -> None:
    """The gateway must import the tree's own frontend, not the installed (editable) pagedserve."""
    origin = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('frontend').origin)"],
                            cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(origin).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"--tree {tree}: python imports frontend from {origin}, not from the tree")


@contextlib.contextmanager
def gateway(tree: str, address: str, model: str, engine: subprocess.Popen) -> Iterator[tuple[int, str]]:
    """A fresh gateway process of `tree`, healthy: (pid, base URL); stopped on leaving."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    command = [sys.executable, "-m", "frontend.api.server", "--engine-address", address, "--model", model,
               "--port", str(port)]
    process = subprocess.Popen(command, cwd=tree, env=tree_env(tree), stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(base_url):
            if process.poll() is not None or engine.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the gateway of {tree} did not become healthy (exit code {process.poll()}, "
                                   f"engine {engine.poll()}); its log ends:\n{log.read()[-3000:]}")
            time.sleep(0.2)
        yield process.pid, base_url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        process.kill()  # a no-op once it has exited
        process.wait()
        log.close()


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 (HTTPError) while the engine handshake is under way
        return False


def stream(base_url: str, model: str, streams: int, tokens: int, input_len: int, vocab: int) -> int:
    """All streams at once through the real benchmark client; returns the tokens streamed (raises on a failure)."""
    import uvloop
    from serve import make_requests, run_benchmark

    requests = make_requests(streams, input_len, tokens, vocab, seed=0)
    metrics = uvloop.run(run_benchmark(base_url, model, requests))["metrics"]
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} of {streams} streams failed: {metrics['errors']}")
    return metrics["total_output_tokens"]


def cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(tree: str, args: argparse.Namespace, address: str, engine: subprocess.Popen) -> tuple[float, float]:
    """One round: a fresh gateway of `tree`, warmed up, then timed; (gateway, client) µs per token."""
    import psutil

    with gateway(tree, address, args.model, engine) as (pid, base_url):
        stream(base_url, args.model, args.streams, min(args.tokens, WARM_UP_TOKENS), args.input_len, args.vocab)
        server, client = psutil.Process(pid), psutil.Process()
        server_start, client_start = cpu_s(server), cpu_s(client)
        tokens = stream(base_url, args.model, args.streams, args.tokens, args.input_len, args.vocab)
        server_us, client_us = cpu_s(server) - server_start, cpu_s(client) - client_start
    return server_us * 1e6 / tokens, client_us * 1e6 / tokens


def run_rounds(args: argparse.Namespace) -> None:
    for tree in args.tree:
        check_tree(tree)
    address = private_ipc_address()
    max_model_len = max(4096, args.input_len + args.tokens + 1)
    engine = subprocess.Popen([sys.executable, __file__, "--stand-in-engine", address, "--model", args.model,
                               "--max-model-len", str(max_model_len)])
    results: dict[str, list[float]] = {tree: [] for tree in args.tree}
    print(f"{args.streams} streams x {args.tokens} tokens, {args.input_len}-token prompts, one token per stream "
          f"every {STEP_S * 1000:.0f} ms; CPU per streamed token (µs)")
    print(f"{'tree':<32}{'round':>6}{'gateway':>10}{'client':>10}", flush=True)
    try:
        for round_index in range(args.rounds):
            for tree in args.tree:
                server_us, client_us = measure(tree, args, address, engine)
                results[tree].append(server_us)
                print(f"{tree:<32}{round_index:>6}{server_us:>10.1f}{client_us:>10.1f}", flush=True)
    finally:
        engine.terminate()
        engine.wait(10)
        remove_ipc_files(EngineEndpoints.from_address(address))
    print(f"median gateway µs per token (target ≤ {TARGET_US:.0f}):")
    for tree, values in results.items():
        median = statistics.median(values)
        print(f"  {tree:<30}{median:>8.1f}  {'ok' if median <= TARGET_US else 'OVER TARGET'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", help="source tree whose gateway to run (repeat; default: this one)")
    parser.add_argument("--model", help=f"model folder for the tokenizer (default: {DEFAULT_MODEL})")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128, help="tokens streamed per request")
    parser.add_argument("--input-len", type=int, default=32, help="prompt token ids per request")
    parser.add_argument("--rounds", type=int, default=4, help="each round runs every tree once")
    parser.add_argument("--stand-in-engine", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=4096, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        if not DEFAULT_MODEL.is_dir():
            parser.error(f"{DEFAULT_MODEL} does not exist (the tests make it): give --model FOLDER")
        args.model = str(DEFAULT_MODEL)
    if args.stand_in_engine:
        StandInEngine(args.stand_in_engine, args.model, args.max_model_len).run()
        return
    args.tree = [str(Path(tree).resolve()) for tree in args.tree or [str(REPO_ROOT)]]
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    run_rounds(args)


if __name__ == "__main__":
    main()
