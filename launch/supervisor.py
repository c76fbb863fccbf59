"""The launcher's processes: its engine cores (one, or one per data-parallel rank) and --api-server-count gateways
sharing one port, supervised until Ctrl-C / SIGTERM, then taken down in order (in-flight requests get
--shutdown-timeout)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgspec

from core.engine_spawn import EngineProcess, child_env, data_parallel_configs, start_engines
from frontend.api.cli_args import API_KEY_ENV, gateway_argv
from ipc import EngineConfig
from ipc.lifeline import make_lifeline
from launch.dp_nodes import placement
from launch.shipped import DEMO_CHAT_PROMPT, DEMO_MODEL_NAME

logger = logging.getLogger("pagedserve.launch")
_GATEWAY_START_TIMEOUT_S = 120.0


def curl_example(args: argparse.Namespace, model_name: str, chat: bool, pooling: bool = False) -> str:
    """A request to paste into a shell: the key stays in $PAGEDSERVE_API_KEY, never on the screen. A pooling
    model's is an embeddings request."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{args.port}/v1/"
    if pooling:
        url, body = url + "embeddings", {"input": "Hello, my name is"}
    elif chat:
        content = DEMO_CHAT_PROMPT if model_name == DEMO_MODEL_NAME else "Hello!"
        url, body = url + "chat/completions", {"messages": [{"role": "user", "content": content}]}
    else:
        url, body = url + "completions", {"prompt": "Hello, my name is"}
    body = {"model": model_name, **body, **({} if pooling else {"max_tokens": 32})}
    command = f"curl {shlex.quote(url)} -H 'Content-Type: application/json'"
    if args.api_key or os.environ.get(API_KEY_ENV):
        command += f' -H "Authorization: Bearer ${API_KEY_ENV}"'
    return f"{command} -d {shlex.quote(json.dumps(body))}"


def has_chat_template(folder: str) -> bool:
    """Whether the tokenizer files in `folder` carry a chat template (read without loading the tokenizer)."""
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as file:
            return bool(json.load(file).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


class Launcher:
    def __init__(self, args: argparse.Namespace, config: EngineConfig) -> None:
        self.args, self.config = args, config
        self.stop = threading.Event()
        self.gateways: list[subprocess.Popen] = []
        self.lifelines: list[int] = []
        self.metrics_dir: str | None = None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop.set())
        where = placement(self.args, self.config.data_parallel_size)
        local = msgspec.structs.replace(self.config, data_parallel_size=len(where.local_addresses))
        first_rank = self.config.data_parallel_size - len(where.local_addresses) if where.headless else 0
        configs = data_parallel_configs(local, sorted(os.sched_getaffinity(0)), first_rank)
        addresses = where.local_addresses
        engines = start_engines(configs, addresses, self.args.curve_key_file, self.args.engine_insecure_loopback)
        if where.headless:
            try:
                logger.info("engine core(s) at %s: start the gateways' launcher with --data-parallel-remote %s",
                            ", ".join(addresses), ",".join(addresses))
                engines_died = self._supervise(engines)
            finally:
                for engine in engines:
                    engine.shutdown()
            return 1 if engines_died else 0
        try:
            self._start_gateways(",".join(addresses + where.remote_addresses))
            model_name = self.args.served_model_name or self.config.model
            logger.info("serving %s at %s://%s:%d/v1 (%d gateway process(es)); engine core(s) at %s", model_name,
                        "https" if getattr(self.args, "ssl_certfile", None) else "http", self.args.host,
                        self.args.port, len(self.gateways), ", ".join(addresses))
            self._print_example(model_name, engines[0].info.runner == "pooling")
            gateway_died = self._supervise(engines)
        finally:
            self._stop_gateways()
            for engine in engines:
                engine.shutdown()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 1 if gateway_died else 0

    def _print_example(self, model_name: str, pooling: bool) -> None:
        args = self.args
        chat = getattr(args, "chat_template", None) is not None or has_chat_template(
            getattr(args, "tokenizer", None) or self.config.model)
        if (args.api_key or os.environ.get(API_KEY_ENV)) and not os.environ.get(API_KEY_ENV):
            print(f"# with the server's API key in ${API_KEY_ENV}:")
        print(f"Ready. Try:\n{curl_example(args, model_name, chat, pooling)}", flush=True)

    def _start_gateways(self, address: str) -> None:
        count = self.args.api_server_count
        if count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {count}")
        extra = {}
        if count > 1:  # the gateways' request metrics are summed through files in this directory
            self.metrics_dir = extra["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="pagedserve-metrics-")
        api_key = self.args.api_key or os.environ.get(API_KEY_ENV)
        if api_key:
            extra[API_KEY_ENV] = api_key  # not on the command line, where `ps` would show it
        statuses = [self._start_gateway(address, count > 1, child_env(**extra)) for _ in range(count)]
        for status in statuses:
            self._wait_gateway_ready(status)

    def _start_gateway(self, address: str, reuse_port: bool, env: dict[str, str]) -> int:
        status_read, status_write = os.pipe()
        lifeline_read, lifeline_write = make_lifeline()
        args = self.args
        command = [sys.executable, "-m", "frontend.api.server", "--engine-address", address,
                   "--model", self.config.model, "--host", args.host, "--port", str(args.port),
                   "--shutdown-timeout", str(args.shutdown_timeout), "--max-n", str(args.max_n),
                   "--max-stop", str(args.max_stop), "--status-fd", str(status_write),
                   "--parent-fd", str(lifeline_read)]
        command += ["--served-model-name", args.served_model_name] if args.served_model_name else []
        command += ["--model-root", args.model_root] if getattr(args, "model_root", None) else []
        command += ["--curve-key-file", args.curve_key_file] if args.curve_key_file else []
        command += ["--reuse-port"] if reuse_port else []
        command += gateway_argv(args)
        command += ["--data-parallel-routing", self.config.data_parallel_routing] if "," in address else []
        self.gateways.append(subprocess.Popen(command, pass_fds=(status_write, lifeline_read), env=env,
                                              start_new_session=True))
        os.close(status_write)
        os.close(lifeline_read)
        self.lifelines.append(lifeline_write)
        return status_read

    def _wait_gateway_ready(self, status_fd: int) -> None:
        with os.fdopen(status_fd, "rb") as status:
            ready, _, _ = select.select([status], [], [], _GATEWAY_START_TIMEOUT_S)
            if not ready or not status.readline():
                raise TimeoutError("a gateway process did not start (see its log above)")

    def _supervise(self, engines: list[EngineProcess]) -> bool:
        """Until a signal, a gateway's death (then everything is taken down) or, headless, the last engine core's.
        True if a gateway (headless: every engine core) died.

        A dead engine core does not take the gateways down: they answer /health with 503 and its requests with
        errors (the other data-parallel engines serve on), which is what a load balancer or orchestrator needs to
        see to restart this server. The operator's SIGTERM or Ctrl-C that follows is a requested stop, so it exits
        0 like any other."""
        reported: set[int] = set()
        while not self.stop.wait(0.2):
            for rank, engine in enumerate(engines):
                if not engine.is_alive() and rank not in reported:
                    engine.end_group()
                    logger.error("engine core %d exited (code %s); the gateways now answer 503", rank,
                                 engine.returncode)
                    reported.add(rank)
            if not self.gateways and not any(engine.is_alive() for engine in engines):
                logger.error("every engine core of this headless launcher exited")
                return True
            for gateway in self.gateways:
                if gateway.poll() is not None:
                    logger.error("gateway %d exited (code %s); shutting down", gateway.pid, gateway.returncode)
                    return True
        logger.info("shutting down: in-flight requests get up to %.0f s", self.args.shutdown_timeout)
        return False

    def _stop_gateways(self) -> None:
        for gateway in self.gateways:
            if gateway.poll() is None:
                gateway.terminate()  # uvicorn stops accepting and lets in-flight requests finish
        deadline = time.monotonic() + self.args.shutdown_timeout + 5
        for gateway in self.gateways:
            try:
                gateway.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        for fd in self.lifelines:
            os.close(fd)
        self.lifelines = []

