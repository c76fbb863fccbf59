"""The gateway's command line, and the flags the launcher passes through to each gateway process as given."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend.api.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES, MediaOptions
from frontend.api.push import HEADER_TIMEOUT_S
from frontend.core_client import DEFAULT_MAX_STALL_S
from ipc.config import DP_ROUTING
from ipc.multimodal import MAX_IMAGES_PER_PROMPT

API_KEY_ENV = "PAGEDSERVE_API_KEY"
MAX_CHOICES_PER_REQUEST = 1024  # ServerLimits' default; not imported from there, which loads transformers
DEFAULT_IMAGES_PER_PROMPT = 4
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def cors_options(args: argparse.Namespace) -> CorsOptions | None:
    """None without --allowed-origins: no CORS middleware, so browsers on other origins are refused (their default)."""
    if args.allowed_origins is None:
        return None
    return CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The tool-call parser serving tool_choice "auto", or None when it is not served; ValueError if
    --enable-auto-tool-choice comes without a parser."""
    if not getattr(args, "enable_auto_tool_choice", False):
        return None
    if getattr(args, "tool_call_parser", None) is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    return args.tool_call_parser


def check_lora_flags(args: argparse.Namespace) -> None:
    """ValueError for --allow-runtime-lora without a --lora-dir folder (network clients name no arbitrary paths)."""
    if getattr(args, "allow_runtime_lora", False):
        lora_dir = getattr(args, "lora_dir", None)
        if not lora_dir or not Path(lora_dir).is_dir():
            raise ValueError("--allow-runtime-lora needs --lora-dir, an existing folder the adapters lie under")


def media_options(args: argparse.Namespace) -> MediaOptions:
    """Where chat images may come from, and their limits; ValueError for a media folder that does not exist."""
    folder = args.allowed_local_media_path
    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"--allowed-local-media-path {folder}: not an existing folder")
    return MediaOptions(None if folder is None else Path(folder).resolve(), args.allow_remote_media,
                        args.max_image_bytes, args.media_fetch_timeout,
                        args.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT))


def mm_limits(text: str) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt: modality=N pairs, comma-separated ("image=2"), or JSON ('{"image": 2}')."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not a JSON object: {error}") from None
        if not isinstance(given, dict):
            raise argparse.ArgumentTypeError('must be a JSON object such as {"image": 2}')
    else:
        pairs = [pair.partition("=") for pair in text.split(",") if pair.strip()]
        if any(not equals for _, equals, _ in pairs):
            raise argparse.ArgumentTypeError("must be modality=N pairs such as image=2")
        given = {name.strip(): count.strip() for name, _, count in pairs}
    limits = {}
    for name, count in given.items():
        if name != "image":
            raise argparse.ArgumentTypeError(f"{name}: this server takes image inputs only")
        if isinstance(count, bool) or not str(count).isdigit() or int(count) > MAX_IMAGES_PER_PROMPT:
            raise argparse.ArgumentTypeError(f"image={count}: the count must be a whole number from 0 to "
                                             f"{MAX_IMAGES_PER_PROMPT} (the most the engine takes)")
        limits[name] = int(count)
    return limits


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def str_list(text: str) -> list[str]:
    """A JSON list ('["a", "b"]') or a comma-separated one ("a,b"), as vLLM's CORS flags take."""
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not a JSON list: {error}") from None
        if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return values
    return [value.strip() for value in text.split(",") if value.strip()]


# (flag, argparse keywords): the gateway's own defaults live here; the launcher leaves an unset flag out of the
# gateway's command line, so these defaults are the only ones.
GATEWAY_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--tokenizer", dict(help="folder to load the tokenizer from (default: the model's)")),
    ("--chat-template", dict(help="a Jinja chat template, or a file holding one, used instead of (or where there "
                                  "is none, as) the tokenizer's")),
    ("--generation-config", dict(default="auto", help="sampling defaults for fields a request leaves out: 'auto' "
                                 "the model folder's generation_config.json, 'vllm' none, or a folder holding "
                                 "a generation_config.json (default: %(default)s)")),
    ("--max-choices-per-request", dict(type=int, default=MAX_CHOICES_PER_REQUEST,
                                       help="most prompts x n in one request (default: %(default)s)")),
    ("--header-timeout", dict(type=float, default=HEADER_TIMEOUT_S,
                              help="seconds a connection gets to send a request's headers (default: %(default)s)")),
    ("--keep-alive-timeout", dict(type=float, default=5.0,
                                  help="seconds an idle keep-alive connection stays open (default: %(default)s)")),
    ("--engine-stall-timeout", dict(type=float, default=DEFAULT_MAX_STALL_S,
                                    help="/health answers 503 once the engine's loop has not advanced (one step has "
                                         "run) for this many seconds (default: %(default)s)")),
    ("--allowed-origins", dict(type=str_list, help="CORS: origins allowed to call the API from a browser, a JSON "
                                                   "list or comma-separated ('*': any); default: no CORS headers")),
    ("--allowed-methods", dict(type=str_list, default=["*"], help="CORS: allowed methods (default: any)")),
    ("--allowed-headers", dict(type=str_list, default=["*"], help="CORS: allowed request headers (default: any)")),
    ("--allow-credentials", dict(action="store_true", help="CORS: allow cookies and credentials")),
    ("--ssl-keyfile", dict(help="serve HTTPS with this private key")),
    ("--ssl-certfile", dict(help="serve HTTPS with this certificate (chain)")),
    ("--root-path", dict(default="", help="the path prefix a proxy in front strips (uvicorn's root_path)")),
    ("--uvicorn-log-level", dict(default="warning", choices=UVICORN_LOG_LEVELS,
                                 help="uvicorn's log level (default: %(default)s)")),
    ("--enable-auto-tool-choice", dict(action="store_true", help='serve tool_choice "auto" (needs '
                                                                  "--tool-call-parser)")),
    ("--tool-call-parser", dict(choices=("hermes", "llama3_json"), help='the format of the model\'s own tool '
                                "calls, read under tool_choice \"auto\": hermes (<tool_call>{...}</tool_call>) or "
                                "llama3_json")),
    ("--reasoning-parser", dict(choices=("deepseek_r1", "qwen3"), help="split the model's <think>...</think> "
                                "section into reasoning_content; an output constraint applies after it")),
    ("--lora-modules", dict(nargs="+", help="LoRA adapters served as models: NAME=PATH ... (the request's model "
                                           "names one; needs the engine's --enable-lora)")),
    ("--allow-runtime-lora", dict(action="store_true", help="serve /v1/load_lora_adapter and "
                                                            "/v1/unload_lora_adapter (needs --lora-dir)")),
    ("--lora-dir", dict(help="with --allow-runtime-lora: the folder runtime-loaded adapters must lie under")),
    ("--max-concurrent-requests-per-key", dict(type=positive_int, help="most POST requests one client has in "
                                               "flight at once "
                                               "(a client: its API key, or its connection without one); past it "
                                               "a 429 (default: no limit)")),
    ("--disable-log-requests", dict(action="store_true", help="no log line per finished request")),
    ("--log-prompts", dict(action="store_true", help="put each request's prompt and output text in its log line "
                                                     "(they may hold personal data)")),
    ("--max-log-len", dict(type=int, help="with --log-prompts: at most this many characters (or token ids) each")),
    ("--allowed-local-media-path", dict(help="read file:// image URLs, of files under this folder only (symlinks "
                                             "and .. resolved first); default: file:// URLs are refused")),
    ("--allow-remote-media", dict(action="store_true", help="fetch http(s) image URLs (default: refused)")),
    ("--max-image-bytes", dict(type=positive_int, default=DEFAULT_MAX_IMAGE_BYTES,
                               help="largest encoded image taken, in bytes (default: %(default)s)")),
    ("--media-fetch-timeout", dict(type=positive_float, default=DEFAULT_FETCH_TIMEOUT_S,
                                   help="seconds an http(s) image fetch may take (default: %(default)s)")),
    ("--limit-mm-per-prompt", dict(type=mm_limits, default={"image": DEFAULT_IMAGES_PER_PROMPT},
                                   help='most images in one prompt: image=N, or JSON {"image": N} '
                                        "(default: %(default)s)")),
    ("--max-stored-responses", dict(type=positive_int, default=1000, help="/v1/responses: how many responses each "
                                    "gateway keeps for previous_response_id, the least recently used dropped "
                                    "(default: %(default)s)")),
)


def add_gateway_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, pass_through: bool = False) -> None:
    """GATEWAY_FLAGS on `parser`; pass_through (the launcher): unset flags stay out of the namespace."""
    for flag, options in GATEWAY_FLAGS:
        if pass_through:  # the help still shows the gateway's default
            help_text = options["help"].replace("%(default)s", str(options.get("default")))
            options = options | {"default": argparse.SUPPRESS, "help": help_text}
        parser.add_argument(flag, **options)


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The GATEWAY_FLAGS set in `args` (parsed with pass_through) as a gateway command line."""
    argv = []
    for flag, options in GATEWAY_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if dest not in vars(args):
            continue
        value = getattr(args, dest)
        if options.get("action") == "store_true":
            argv += [flag] if value else []
        else:  # --flag=value: a value that starts with "-" (a template, say) stays a value
            argv.append(f"{flag}={json.dumps(value) if isinstance(value, (list, dict)) else value}")
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend.api.server",
                                     description="The OpenAI-compatible HTTP gateway in front of an engine core.")
    parser.add_argument("--engine-address", required=True,
                        help="the engine core's address, or data-parallel engine cores' addresses joined by commas")
    parser.add_argument("--data-parallel-routing", choices=DP_ROUTING, default="prefix",
                        help="with several engine cores: which one takes a request (frontend/dp_balance.py)")
    parser.add_argument("--curve-key-file")
    parser.add_argument("--model", help="model folder for the tokenizer (default: the engine's)")
    parser.add_argument("--served-model-name", help="the model id clients use (default: --model)")
    parser.add_argument("--model-root", help="the model's root in /v1/models (default: the model folder)")
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
    add_gateway_flags(parser)
    return parser
