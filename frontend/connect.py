"""How a front end gets its engine core: start a private one (default), attach to one at an address, or
run one in-process for debugging."""
from __future__ import annotations

import torch

from frontend.core_client import AsyncEngineCoreClient, EngineCoreClient
from frontend.inprocess_client import InProcessEngineCoreClient
from ipc import EngineConfig


def engine_config(model: str | None, engine_args: dict) -> EngineConfig:
    if model is None:
        raise ValueError("model (a model folder) is required to start an engine core")
    unknown = set(engine_args) - set(EngineConfig.__struct_fields__)
    if unknown:
        raise ValueError(f"unknown engine arguments {sorted(unknown)}; "
                         f"known: {sorted(set(EngineConfig.__struct_fields__) - {'model'})}")
    return EngineConfig(model=str(model), **engine_args)


def connect_engine(model: str | None, engine_args: dict, *, in_process: bool = False,
                   engine_address: str | None = None, curve_key_file: str | None = None,
                   handshake_timeout: float = 30.0, asynchronous: bool = False
                   ) -> EngineCoreClient | AsyncEngineCoreClient | InProcessEngineCoreClient:
    client_class = AsyncEngineCoreClient if asynchronous else EngineCoreClient
    if engine_address is not None:
        if engine_args or in_process:
            raise ValueError(f"engine arguments {sorted(engine_args)} cannot apply to the engine core already "
                             f"running at {engine_address}; set them where it is started")
        return client_class(engine_address, curve_key_file, handshake_timeout)
    # A private engine's socket is in a directory only its owner can enter: the owner may reset its cache.
    config = engine_config(model, {"enable_cache_reset": True, **engine_args})
    if in_process:
        if asynchronous:
            raise ValueError("AsyncLLM always runs its engine core in a separate process (in_process=False)")
        return InProcessEngineCoreClient(config)
    # The engine process does the compute; two processes each running 2 torch threads on 2 cores halve it.
    torch.set_num_threads(1)
    return client_class.start(config)
