"""The gateway's app in this process, wired from `pagedserve` flags the way a gateway process wires it from its own,
so batch lines get the HTTP routes' validation, defaults and response bodies."""
from __future__ import annotations

import argparse

from fastapi import FastAPI

from frontend.api.cli_args import build_parser, gateway_argv
from frontend.api.request_log import RequestLogger
from frontend.api.server import gateway_app as gateway_app_of_flags
from frontend.async_llm import AsyncLLM


def gateway_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The gateway's flags with its own defaults for those the launcher's `args` leave unset."""
    return build_parser().parse_args(["--engine-address=in-process", "--max-n", str(args.max_n),
                                      "--max-stop", str(args.max_stop), *gateway_argv(args)])


def gateway_app(args: argparse.Namespace, engine: AsyncLLM, model_folder: str) -> FastAPI:
    """The app a `pagedserve` gateway would serve with these flags, without its API key: nothing here listens.
    Requests are logged only with --log-prompts: the output file is the record of each line."""
    flags = gateway_flags(args)
    return gateway_app_of_flags(flags, engine, args.served_model_name or model_folder, model_folder, None,
                                RequestLogger(True, flags.max_log_len) if flags.log_prompts else None)
