"""The OpenAI-compatible HTTP gateway (FastAPI + uvicorn) in front of an engine core.

Run by the launcher, one process per `--api-server-count`, all sharing one port (SO_REUSEPORT):
`python -m frontend.api.server --engine-address ipc:///... --model FOLDER --port 8000`.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import socket
import time
from importlib.metadata import PackageNotFoundError, version

import msgspec
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from frontend.api.choices import RequestObservers
from frontend.api.client_budget import ClientBudget
from frontend.api.cli_args import (CorsOptions, auto_tool_parser, build_parser, check_lora_flags, cors_options,
                                   media_options)
from frontend.api.errors import APIError
from frontend.api.guard import Guard
from frontend.api.lora_adapters import LoRAAdapters, parse_lora_modules
from frontend.api.media import MediaOptions
from frontend.api.route_errors import add_error_handlers, cancel_on_disconnect
from frontend.api.messages_api import add_messages_routes
from frontend.api.metrics import ServerMetrics
from frontend.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                                   TokenizeRequest, UnloadLoRAAdapterRequest)
from frontend.api.pooling_protocol import ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from frontend.api.pooling_serving import PoolingServing
from frontend.api.push import PushHttpToolsProtocol
from frontend.api.request_log import RequestLogger
from frontend.api.responses_api import DEFAULT_MAX_STORED_RESPONSES, add_responses_routes
from frontend.api.sampling import ServerLimits
from frontend.api.serving import OpenAIServing
from frontend.async_llm import AsyncLLM
from frontend.core_client import DEFAULT_MAX_STALL_S, EngineDeadError
from frontend.data_parallel import EnginesDownError
from frontend.generation_config import load_generation_defaults
from frontend.tokenizer import load_chat_template
from ipc.lifeline import watch_lifeline

logger = logging.getLogger("pagedserve.api")


def build_app(engine: AsyncLLM, model_name: str, limits: ServerLimits, api_key: str | None = None,
              max_body_bytes: int = 10 * 2**20, max_header_bytes: int = 32 * 2**10,
              max_stall_s: float = DEFAULT_MAX_STALL_S, *, chat_template: str | None = None,
              model_root: str | None = None, generation_defaults: dict[str, float | int] | None = None,
              request_logger: RequestLogger | None = None, cors: CorsOptions | None = None,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              adapters: LoRAAdapters | None = None, max_requests_per_client: int | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, media: MediaOptions | None = None) -> FastAPI:
    """The gateway's app. `chat_template` (a template's text) replaces the tokenizer's, whose gateway this is;
    `model_root` is the model's root in /v1/models (default: the engine's model folder); /v1/responses keeps the
    last `max_stored_responses` for previous_response_id; `media` says where chat images may come from."""
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    metrics = ServerMetrics(model_name, limits.max_model_len)
    adapters = adapters or LoRAAdapters(model_name, {})
    serving = OpenAIServing(engine, model_name, limits, RequestObservers(metrics, request_logger), generation_defaults,
                            tool_parser, reasoning_parser, adapters, media)
    # The contract is served (behind the key) for clients and fuzzers; the docs UIs would load scripts from a CDN.
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    if max_requests_per_client is not None:  # inside the guard: only requests with a valid key count
        app.add_middleware(ClientBudget, max_requests=max_requests_per_client)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    if cors is not None:  # added last, so outermost: a browser's preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        # From the engine's heartbeats: answered at once, however long the step the engine is in.
        try:
            await engine.check_health(max_stall_s)
        except EngineDeadError as error:
            logger.debug("health check: %s", error)
            message = "engine unavailable"  # no internals: which data-parallel engines, not why
            if isinstance(error, EnginesDownError) and len(error.down) < error.size:
                message = (f"engine core(s) {', '.join(map(str, error.down))} of {error.size} unavailable; "
                           "the others serve")
            return APIError(503, message, code="engine_unavailable").response()
        return Response(status_code=200)

    for method in engine.info.privileged_utilities:  # only those the engine was started to allow
        app.add_api_route(f"/{method}", _utility_route(engine, method), methods=["POST"])

    async def engine_alive() -> None:
        """Routes answered in the gateway alone still say 503 once the engine is gone (every data-parallel one), as
        every route does."""
        await engine.check_serving(max_stall_s)

    @app.get("/v1/models", dependencies=[Depends(engine_alive)])
    async def models() -> dict:
        created = int(time.time())
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "pagedserve",
                "root": model_root or engine.info.model, "parent": None, "max_model_len": limits.max_model_len}
        return {"object": "list", "data": [base, *({**base, "id": name, "root": path, "parent": model_name}
                                                   for name, path in adapters.models())]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict:
        adapter = adapters.candidate(body.lora_name, body.lora_path)
        try:  # read and checked now, off the engine's step loop's hot path: a broken adapter is refused here
            await engine.check_lora(adapter)
        except EngineDeadError:
            raise
        except RuntimeError as error:
            raise APIError(400, f"lora_path {body.lora_path!r}: {error}", "lora_path") from None
        adapters.add(adapter)
        return {"object": "lora_adapter", "id": body.lora_name, "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict:
        adapters.unload(body.lora_name)
        return {"object": "lora_adapter", "id": body.lora_name, "loaded": False}

    @app.get("/version")
    async def server_version() -> dict:
        return {"version": _package_version(), "gateway_pid": os.getpid()}

    @app.get("/load", dependencies=[Depends(engine_alive)])
    async def load() -> dict:
        """vLLM's route for load balancers: the requests the engine holds (running and waiting)."""
        stats = await engine.get_stats()
        return {"server_load": stats.num_running + stats.num_waiting}

    @app.get("/server_info", dependencies=[Depends(engine_alive)])
    async def server_info() -> dict:
        """The engine's model, limits and KV capacity, and this gateway's version."""
        return {"model_name": model_name, "engine": msgspec.to_builtins(engine.info), "version": _package_version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await engine.get_stats()), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", dependencies=[Depends(engine_alive)])
    async def tokenize(body: TokenizeRequest) -> dict:
        return await asyncio.to_thread(serving.tokenize, body)

    @app.post("/detokenize", dependencies=[Depends(engine_alive)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        bad = next((t for t in body.tokens if not 0 <= t < engine.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {engine.info.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, serving.chat(body))

    add_responses_routes(app, serving, max_stored_responses)
    add_messages_routes(app, serving)

    pooling = PoolingServing(engine, model_name, adapters, limits.max_choices_per_request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, pooling.embeddings(body))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, pooling.score(body))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, pooling.rerank(body))

    @app.post("/classify")
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, pooling.classify(body))

    return app


def _utility_route(engine: AsyncLLM, method: str):
    """POST /start_profile, /stop_profile or /reset_prefix_cache: the engine utility's result as JSON."""
    async def call() -> dict:
        try:
            return {"result": await getattr(engine, method)()}
        except RuntimeError as error:  # e.g. the profiler is already running
            raise APIError(409, str(error), code="conflict") from error
    return call


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


def gateway_app(args: argparse.Namespace, engine: AsyncLLM, model_name: str, model_folder: str,
                api_key: str | None, request_logger: RequestLogger | None) -> FastAPI:
    """The app of a gateway with these flags (build_parser's) in front of `engine`; ValueError for a chat
    template, generation config, LoRA module list or media folder that cannot be read."""
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    limits = ServerLimits(max_model_len=engine.info.max_model_len, max_n=args.max_n, max_stop=args.max_stop,
                          max_choices_per_request=args.max_choices_per_request)
    adapters = LoRAAdapters(model_name, parse_lora_modules(args.lora_modules),
                            args.lora_dir if args.allow_runtime_lora else None)
    return build_app(engine, model_name, limits, api_key, args.max_body_bytes, args.max_header_bytes,
                     args.engine_stall_timeout, chat_template=chat_template,
                     model_root=args.model_root or model_folder,
                     generation_defaults=load_generation_defaults(model_folder, args.generation_config),
                     request_logger=request_logger, cors=cors_options(args), tool_parser=auto_tool_parser(args),
                     reasoning_parser=args.reasoning_parser, adapters=adapters,
                     max_requests_per_client=args.max_concurrent_requests_per_key,
                     max_stored_responses=args.max_stored_responses, media=media_options(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.ssl_keyfile and not args.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        auto_tool_parser(args)
        check_lora_flags(args)
        addresses = args.engine_address.split(",")
        engine = AsyncLLM(args.tokenizer or args.model, engine_address=addresses[0] if len(addresses) == 1 else
                          addresses, curve_key_file=args.curve_key_file,
                          **({"data_parallel_routing": args.data_parallel_routing} if len(addresses) > 1 else {}))
    except ValueError as error:
        logger.error("%s", error)
        return 2
    model_name = args.served_model_name or args.model or engine.info.model
    request_logger = None if args.disable_log_requests else RequestLogger(args.log_prompts, args.max_log_len)
    try:
        app = gateway_app(args, engine, model_name, args.model or engine.info.model, args.api_key, request_logger)
    except ValueError as error:
        logger.error("%s", error)
        engine.shutdown()
        return 2
    sock = listening_socket(args.host, args.port, args.reuse_port)
    server = uvicorn.Server(uvicorn_config(app, args))
    if args.parent_fd is not None:
        watch_lifeline(args.parent_fd, lambda: setattr(server, "should_exit", True))
    app.router.on_startup.append(lambda: _report_ready(args.status_fd))
    scheme = "https" if args.ssl_certfile else "http"
    logger.info("gateway %d serving %s at %s://%s:%d/v1", os.getpid(), model_name, scheme, args.host, args.port)
    # Everything made so far (transformers, the tokenizer, the app: ~400,000 objects) lives as long as the process.
    # Frozen, it is out of the cyclic collector's sight; otherwise every full collection walks it, stalling all
    # streams for 0.1-0.2 s, and the gateway spent ~15% more CPU per streamed token.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    engine.shutdown()
    return 0


def uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings from the gateway's flags (TLS, root path, timeouts, log level)."""
    return uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                          timeout_keep_alive=args.keep_alive_timeout, root_path=args.root_path,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          http=functools.partial(PushHttpToolsProtocol, header_timeout=args.header_timeout))


def _report_ready(status_fd: int | None) -> None:
    if status_fd is not None:
        os.write(status_fd, b"ready\n")
        os.close(status_fd)


if __name__ == "__main__":
    raise SystemExit(main())
