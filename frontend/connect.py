"""How a front end gets its engine core: start a private one (default), attach to one at an address, or
run one in-process for debugging."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from frontend.async_core_client import AsyncEngineCoreClient
from frontend.core_client import EngineCoreClient
from ipc import EngineConfig

if TYPE_CHECKING:
    from frontend.inprocess_client import InProcessEngineCoreClient

PROFILER_DIR_ENV = "PAGEDSERVE_TORCH_PROFILER_DIR"


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
    # A private engine's socket is in a directory only its owner can enter: the owner may reset its cache, and
    # profile it into the directory its environment names (vLLM's variable is VLLM_TORCH_PROFILER_DIR).
    defaults = {"enable_cache_reset": True}
    if os.environ.get(PROFILER_DIR_ENV):
        defaults["profiler_dir"] = os.environ[PROFILER_DIR_ENV]
    config = engine_config(model, {**defaults, **engine_args})
    if in_process:
        if asynchronous:
            raise ValueError("AsyncLLM always runs its engine core in a separate process (in_process=False)")
        from frontend.inprocess_client import InProcessEngineCoreClient  # loads torch and workers

        return InProcessEngineCoreClient(config)
    # The engine process does the compute; two processes each running 2 torch threads on 2 cores halve it.
    # Imported only here: a client attaching to an engine_address stays free of torch.
    import torch

    torch.set_num_threads(1)
    return client_class.start(config)
