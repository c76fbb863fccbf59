"""`pagedserve run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [options]`: run an OpenAI batch file (lines of
{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions" | "/v1/embeddings", "body"})
through the HTTP gateway's routes in this process (no port), writing one output line per input line in OpenAI's
batch output shape, in the order the answers come. A line the batch cannot send, or whose request the route
refuses, gets an error line; the run goes on. Rerun with the same OUT to resume: lines already answered there are
skipped. '-' reads stdin or writes stdout (no resuming). The engine options are those of `pagedserve serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import msgspec

from frontend.api.cli_args import positive_int
from frontend.async_llm import AsyncLLM
from launch.batch_gateway import gateway_app
from launch.batch_lines import BatchRequest, Done, answer_line, plan, read_done
from launch.launch import _demo_model, build_parser, check_gateway_flags, engine_config

logger = logging.getLogger("pagedserve.run_batch")
_PROGRESS_EVERY_S = 0.5
_OVERLOADED_RETRY_S = 0.2


class EngineGone(RuntimeError):
    """The engine core stopped: the lines not yet answered stay out of the output, for a rerun to resume."""


def build_batch_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog, parser.description = "pagedserve run-batch", __doc__
    parser.usage = "%(prog)s -i INPUT -o OUTPUT [MODEL] [options]"
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True, help="the batch file, one request a line ('-': stdin)")
    batch.add_argument("-o", "--output-file", required=True,
                       help="where the answers go, one a line; an existing file is resumed ('-': stdout)")
    batch.add_argument("--max-concurrency", type=positive_int, default=64,
                       help="lines in flight at once, for the engine to batch (default: %(default)s)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_batch_parser()
    args = parser.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models: {args.model_tag!r} and --model {args.model!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: the progress lines say it
    try:
        check_gateway_flags(args)
        model = args.model_tag or args.model or _demo_model(args)
        config = engine_config(args, model)
        requests, errors = _pending(args.input_file, args.output_file)
        if not requests and not errors:
            return 0
        engine = AsyncLLM(model, **{name: value for name, value in msgspec.structs.asdict(config).items()
                                    if name != "model"})
    except (ValueError, TimeoutError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        with _output(args.output_file) as output:
            asyncio.run(run(gateway_app(args, engine, model), requests, errors, output, args.max_concurrency))
    except EngineGone as error:
        print(f"error: {error}; rerun the same command to resume", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        engine.shutdown()
    return 0


def _pending(input_name: str, output_name: str) -> tuple[list[BatchRequest], list[dict]]:
    """The requests to send and the error lines to write: the input's lines not yet answered in the output."""
    done = Done() if output_name == "-" else read_done(Path(output_name))
    requests, errors, skipped = plan(_read_input(input_name), done)
    if skipped:
        logger.info("%d line(s) already answered in %s: skipped", skipped, output_name)
    return requests, errors


def _read_input(name: str) -> list[bytes]:
    """The input's lines as bytes: one that is not UTF-8 is that line's error, not the file's."""
    data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    return data.splitlines()


@contextmanager
def _output(name: str) -> Iterator[IO[str]]:
    if name == "-":
        yield sys.stdout
        return
    with open(name, "a", encoding="utf-8", newline="\n") as file:
        yield file


async def run(app, requests: list[BatchRequest], errors: list[dict], output: IO[str], concurrency: int) -> None:
    """Write the error lines, then send the requests, at most `concurrency` at once, writing each answer as it
    comes."""
    progress = Progress(len(requests) + len(errors))
    for record in errors:
        _write(output, record)
        progress.count(error=True)
    pending = iter(requests)

    async def worker(client: httpx.AsyncClient) -> None:
        for request in pending:  # shared: each worker takes the next line when it is free
            record = await _answer(client, request)
            _write(output, record)
            progress.count(error=record["error"] is not None)

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a bug in a route: its 500, not a crash
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(min(concurrency, len(requests)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
    progress.report(final=True)


async def _answer(client: httpx.AsyncClient, request: BatchRequest) -> dict:
    """The output line for one request, sent through the gateway's route for its url."""
    while True:
        response = await client.post(request.url, json=request.body)
        try:
            body = response.json()
        except ValueError:  # not a route's answer (they are JSON): kept as text in an error body
            body = {"error": {"code": str(response.status_code), "message": response.text}}
        error = body.get("error") or {}
        if response.status_code == 429 and error.get("code") == "overloaded":
            # The engine's waiting queue is full (--max-concurrency above --max-waiting-requests): not the line's
            # fault, so it waits its turn.
            await asyncio.sleep(_OVERLOADED_RETRY_S)
            continue
        if response.status_code == 503:
            raise EngineGone(error.get("message", "the engine core is not available"))
        return answer_line(request, response.status_code, body)


def _write(output: IO[str], record: dict) -> None:
    # One write of a whole line: a killed run leaves at most the last line torn, which a resume cuts off.
    output.write(json.dumps(record) + "\n")
    output.flush()


class Progress:
    """Lines answered out of `total` and their rate, on stderr at most every _PROGRESS_EVERY_S."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.errors = total, 0, 0
        self.start = self.last = time.monotonic()

    def count(self, error: bool) -> None:
        self.done += 1
        self.errors += error
        if time.monotonic() - self.last >= _PROGRESS_EVERY_S:
            self.report()

    def report(self, final: bool = False) -> None:
        self.last = time.monotonic()
        rate = self.done / max(self.last - self.start, 1e-9)
        print(f"run-batch: {self.done}/{self.total} lines ({self.errors} error(s)), {rate:.1f} lines/s"
              + (", finished" if final else ""), file=sys.stderr, flush=True)
