"""The engine-core process's entry: `python -m core.engine_process --config-json '{"model": ...}' --address
ipc:///path` (front ends and the launcher do this for you) builds the EngineCore, reports start-up to its parent
and runs core.engine_loop.EngineCoreProc until a signal, its parent's exit or a fatal error.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

import msgspec

from core.engine_core import EngineCore
from core.engine_loop import EngineCoreProc
from ipc import EngineConfig, EngineStartup
from ipc.lifeline import watch_lifeline
from ipc.sockets import CurveKeys, EngineEndpoints, check_binding_is_safe

logger = logging.getLogger("pagedserve.engine_core")


def _report(status_fd: int | None, status: EngineStartup) -> None:
    if status_fd is not None:
        os.write(status_fd, msgspec.json.encode(status) + b"\n")
        os.close(status_fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.engine_process", description=__doc__)
    parser.add_argument("--config-json", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--address", required=True, help="tcp://HOST:PORT or ipc://PATH to listen on")
    parser.add_argument("--curve-key-file", help="CURVE key file (required on tcp://)")
    parser.add_argument("--insecure-loopback", action="store_true", help="serve tcp:// on loopback without a key")
    parser.add_argument("--status-fd", type=int, help="write the start-up result here (set by a parent)")
    parser.add_argument("--parent-fd", type=int, help="exit when this pipe closes (set by a parent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = msgspec.json.decode(args.config_json, type=EngineConfig)
        keys = CurveKeys.load(args.curve_key_file) if args.curve_key_file else None
        endpoints = EngineEndpoints.from_address(args.address)
        check_binding_is_safe(endpoints, keys, args.insecure_loopback)  # before a model loads
        proc = EngineCoreProc(EngineCore(config), endpoints, keys, args.insecure_loopback)
    except Exception as error:
        logger.exception("the engine core failed to start")
        _report(args.status_fd, EngineStartup(error=str(error), error_type=type(error).__name__))
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: proc.request_stop(f"the engine core got signal {signum}"))
    if args.parent_fd is not None:
        watch_lifeline(args.parent_fd, lambda: proc.request_stop("the process that started the engine core exited"))
    _report(args.status_fd, EngineStartup(info=proc.engine.info))
    logger.info("engine core ready: requests at %s, outputs at %s, %d KV blocks of %d tokens, %.1f MiB of weights",
                proc.endpoints.input, proc.endpoints.output, proc.engine.num_kv_blocks, proc.engine.config.block_size,
                proc.engine.info.weight_bytes / 2**20)
    # The model, tokenizer and transformers' modules live as long as the process: frozen, they are out of the
    # cyclic collector's sight, whose full collections otherwise walk them mid-step (~3% of batch-1 decode).
    gc.collect()
    gc.freeze()
    try:
        proc.run()
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    exit_code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed and joined; skip the interpreter's teardown of torch (most of a second).
    os._exit(exit_code)
