"""The OpenAI-compatible HTTP gateway (FastAPI + uvicorn) in front of an engine core.

Run by the launcher, one process per `--api-server-count`, all sharing one port (SO_REUSEPORT):
`python -m frontend.api.server --engine-address ipc:///... --model FOLDER --port 8000`.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import logging
import os
import socket
import time
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from frontend.api.errors import APIError, error_body, from_pydantic
from frontend.api.metrics import ServerMetrics
from frontend.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from frontend.api.push import PushHttpToolsProtocol
from frontend.api.sampling import ServerLimits
from frontend.api.serving import OpenAIServing
from frontend.async_llm import AsyncLLM
from frontend.core_client import EngineDeadError
from frontend.tokenizer import apply_chat_template
from ipc.lifeline import watch_lifeline

logger = logging.getLogger("pagedserve.api")
_HEALTH_TIMEOUT_S = 1.0
API_KEY_ENV = "PAGEDSERVE_API_KEY"


def build_app(engine: AsyncLLM, model_name: str, limits: ServerLimits, api_key: str | None = None,
              max_body_bytes: int = 10 * 2**20, max_header_bytes: int = 32 * 2**10) -> FastAPI:
    metrics = ServerMetrics(model_name)
    serving = OpenAIServing(engine, model_name, limits, metrics)
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(engine.check_health(), _HEALTH_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError) as error:
            return APIError(503, f"the engine is not healthy: {error or 'no answer'}").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "pagedserve", "max_model_len": limits.max_model_len}]}

    @app.get("/version")
    async def server_version() -> dict:
        return {"version": _package_version(), "gateway_pid": os.getpid()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await engine.get_stats()), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [{"role": m.role, "content": m.content or ""} for m in body.messages]
            text = apply_chat_template(engine.tokenizer, messages, model_name)
            tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        bad = next((t for t in body.tokens if not 0 <= t < engine.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {engine.info.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, serving.chat(body))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return from_pydantic(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code)


async def _cancel_on_disconnect(request: Request, handler) -> Response:
    """Run a handler, cancelling it (and so aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(handler)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


class _Guard:
    """ASGI middleware: the API key on every route but /health (constant-time compare), and size caps on the
    headers and the body (checked here, whichever HTTP parser uvicorn picked)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app, self.max_body_bytes, self.max_header_bytes = app, max_body_bytes, max_header_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(name) + len(value) for name, value in scope["headers"]) > self.max_header_bytes:
            return await _send(send, 431, f"the request headers are over the limit of {self.max_header_bytes} bytes")
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send(send, 401, "invalid or missing API key (Authorization: Bearer KEY)")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return await _send(send, 413, f"the request body is over the limit of {self.max_body_bytes} bytes")
        await self.app(scope, self._capped(receive), send)

    def _capped(self, receive):
        received = 0

        async def capped():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # a chunked body without Content-Length
                return {"type": "http.disconnect"}
            return message
        return capped


async def _send(send, status: int, message: str) -> None:
    response = JSONResponse(error_body(status, message), status_code=status)
    await response({"type": "http"}, None, send)


def _package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """Bound here, so several gateway processes can share one port (the kernel spreads connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend.api.server", description=__doc__)
    parser.add_argument("--engine-address", required=True)
    parser.add_argument("--curve-key-file")
    parser.add_argument("--model", help="model folder for the tokenizer (default: the engine's)")
    parser.add_argument("--served-model-name", help="the model id clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--reuse-port", action="store_true", help="share the port with other gateway processes")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"(default: ${API_KEY_ENV})")
    parser.add_argument("--max-n", type=int, default=16)
    parser.add_argument("--max-stop", type=int, default=16)
    parser.add_argument("--max-body-bytes", type=int, default=10 * 2**20)
    parser.add_argument("--max-header-bytes", type=int, default=32 * 2**10)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish")
    parser.add_argument("--status-fd", type=int, help="write 'ready' here once serving (set by the launcher)")
    parser.add_argument("--parent-fd", type=int, help="exit when this pipe closes (set by the launcher)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = AsyncLLM(args.model, engine_address=args.engine_address, curve_key_file=args.curve_key_file)
    model_name = args.served_model_name or args.model or engine.info.model
    limits = ServerLimits(max_model_len=engine.info.max_model_len, max_n=args.max_n, max_stop=args.max_stop)
    app = build_app(engine, model_name, limits, args.api_key, args.max_body_bytes, args.max_header_bytes)
    sock = listening_socket(args.host, args.port, args.reuse_port)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout,
                            http=PushHttpToolsProtocol)
    server = uvicorn.Server(config)
    if args.parent_fd is not None:
        watch_lifeline(args.parent_fd, lambda: setattr(server, "should_exit", True))
    app.router.on_startup.append(lambda: _report_ready(args.status_fd))
    logger.info("gateway %d serving %s at http://%s:%d/v1", os.getpid(), model_name, args.host, args.port)
    # Everything made so far (transformers, the tokenizer, the app: ~400,000 objects) lives as long as the process.
    # Frozen, it is out of the cyclic collector's sight; otherwise every full collection walks it, stalling all
    # streams for 0.1-0.2 s, and the gateway spent ~15% more CPU per streamed token.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    engine.shutdown()
    return 0


def _report_ready(status_fd: int | None) -> None:
    if status_fd is not None:
        os.write(status_fd, b"ready\n")
        os.close(status_fd)


if __name__ == "__main__":
    raise SystemExit(main())
