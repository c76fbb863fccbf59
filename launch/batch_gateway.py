"""The gateway's app in this process, wired from `pagedserve` flags the way a gateway process wires it from its own,
so batch lines get the HTTP routes' validation, defaults and response bodies."""
from __future__ import annotations

import argparse

from fastapi import FastAPI

from frontend.api.cli_args import auto_tool_parser, build_parser, gateway_argv
from frontend.api.lora_adapters import LoRAAdapters, parse_lora_modules
from frontend.api.request_log import RequestLogger
from frontend.api.sampling import ServerLimits
from frontend.api.server import build_app
from frontend.async_llm import AsyncLLM
from frontend.generation_config import load_generation_defaults
from frontend.tokenizer import load_chat_template


def gateway_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The gateway's flags with its own defaults for those the launcher's `args` leave unset."""
    return build_parser().parse_args(["--engine-address=in-process", "--max-n", str(args.max_n),
                                      "--max-stop", str(args.max_stop), *gateway_argv(args)])


def gateway_app(args: argparse.Namespace, engine: AsyncLLM, model_folder: str) -> FastAPI:
    """The app a `pagedserve` gateway would serve with these flags, without its API key: nothing here listens.
    Requests are logged only with --log-prompts: the output file is the record of each line."""
    flags = gateway_flags(args)
    model_name = args.served_model_name or model_folder
    limits = ServerLimits(max_model_len=engine.info.max_model_len, max_n=flags.max_n, max_stop=flags.max_stop,
                          max_choices_per_request=flags.max_choices_per_request)
    adapters = LoRAAdapters(model_name, parse_lora_modules(flags.lora_modules),
                            flags.lora_dir if flags.allow_runtime_lora else None)
    return build_app(engine, model_name, limits, max_stall_s=flags.engine_stall_timeout,
                     chat_template=None if flags.chat_template is None else load_chat_template(flags.chat_template),
                     model_root=getattr(args, "model_root", None) or model_folder,
                     generation_defaults=load_generation_defaults(model_folder, flags.generation_config),
                     request_logger=RequestLogger(True, flags.max_log_len) if flags.log_prompts else None,
                     tool_parser=auto_tool_parser(flags), reasoning_parser=flags.reasoning_parser, adapters=adapters)
