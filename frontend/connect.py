"""How a front end gets its engine core: start a private one (default) or several (data parallel), attach to one
at an address, or run one in-process for debugging."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from frontend.async_core_client import AsyncEngineCoreClient
from frontend.core_client import EngineCoreClient
from frontend.data_parallel import AsyncDataParallelClient, DataParallelClient
from ipc import EngineConfig
from ipc.config import DP_ROUTING
from ipc.sockets import private_ipc_address

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
                   engine_address: str | list[str] | None = None, curve_key_file: str | None = None,
                   handshake_timeout: float = 30.0, asynchronous: bool = False
                   ) -> EngineCoreClient | AsyncEngineCoreClient | InProcessEngineCoreClient | DataParallelClient:
    client_class = AsyncEngineCoreClient if asynchronous else EngineCoreClient
    if engine_address is not None:
        addresses = [engine_address] if isinstance(engine_address, str) else list(engine_address)
        routing = engine_args.pop("data_parallel_routing", "prefix") if len(addresses) > 1 else None
        if engine_args or in_process:
            raise ValueError(f"engine arguments {sorted(engine_args)} cannot apply to the engine core already "
                             f"running at {engine_address}; set them where it is started")
        if routing is None:
            return client_class(addresses[0], curve_key_file, handshake_timeout)
        if routing not in DP_ROUTING:
            raise ValueError(f"data_parallel_routing must be one of {DP_ROUTING}, got {routing!r}")
        clients = []
        try:
            for address in addresses:
                clients.append(client_class(address, curve_key_file, handshake_timeout))
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        return (AsyncDataParallelClient if asynchronous else DataParallelClient)(clients, routing)
    # A private engine's socket is in a directory only its owner can enter: the owner may reset its cache, and
    # profile it into the directory its environment names (vLLM's variable is VLLM_TORCH_PROFILER_DIR).
    defaults = {"enable_cache_reset": True}
    if os.environ.get(PROFILER_DIR_ENV):
        defaults["profiler_dir"] = os.environ[PROFILER_DIR_ENV]
    config = engine_config(model, {**defaults, **engine_args})
    if config.data_parallel_size > 1:
        if in_process:
            raise ValueError("data_parallel_size > 1 runs each engine core in a process of its own (in_process=False)")
        return start_data_parallel(config, asynchronous)
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


def start_data_parallel(config: EngineConfig, asynchronous: bool) -> DataParallelClient:
    """config.data_parallel_size private engine cores, started side by side, behind one client."""
    from core.engine_spawn import data_parallel_configs, start_engines

    import torch

    torch.set_num_threads(1)
    configs = data_parallel_configs(config, sorted(os.sched_getaffinity(0)))
    addresses = [private_ipc_address() for _ in configs]
    processes = start_engines(configs, addresses)
    client_class = AsyncEngineCoreClient if asynchronous else EngineCoreClient
    clients = [client_class(address, process=process) for address, process in zip(addresses, processes)]
    return (AsyncDataParallelClient if asynchronous else DataParallelClient)(clients, config.data_parallel_routing)
