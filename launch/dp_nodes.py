"""Data parallel over several machines: which engine cores this launcher starts and at which addresses, and which
other machines' engines its gateways attach to (vLLM's --data-parallel-size-local / --headless)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ipc.sockets import private_ipc_address


@dataclass
class Placement:
    local_addresses: list[str]  # the engine cores this launcher starts, in rank order
    remote_addresses: list[str]  # other launchers' engine cores (--headless), after these in rank order
    headless: bool  # engines only: no gateway; another machine's gateways attach to them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallel over several machines")
    group.add_argument("--data-parallel-size-local", type=int,
                       help="engine cores this launcher starts (default: all of --dp); the others run on other "
                            "machines, started there with --headless")
    group.add_argument("--headless", action="store_true",
                       help="start this machine's engine cores and no gateway; they listen at tcp://"
                            "--data-parallel-address:--data-parallel-rpc-port (+1 for each next one), CURVE with "
                            "--curve-key-file")
    group.add_argument("--data-parallel-address", help="--headless: the address its engine cores listen on")
    group.add_argument("--data-parallel-rpc-port", type=int, default=5570,
                       help="--headless: the first engine core's port")
    group.add_argument("--data-parallel-remote",
                       help="the other machines' engine cores (tcp://HOST:PORT,...), which this launcher's gateways "
                            "attach to after its own")


def placement(args: argparse.Namespace, data_parallel_size: int) -> Placement:
    """Where each engine core of the group runs, as the flags say (ValueError naming a flag that does not fit)."""
    local = data_parallel_size if args.data_parallel_size_local is None else args.data_parallel_size_local
    remote = [address.strip() for address in (args.data_parallel_remote or "").split(",") if address.strip()]
    if not 1 <= local <= data_parallel_size:
        raise ValueError(f"--data-parallel-size-local must be between 1 and --dp ({data_parallel_size}), got {local}")
    if args.headless:
        if remote:
            raise ValueError("--headless starts engine cores for another machine's gateways: no "
                             "--data-parallel-remote")
        if not args.data_parallel_address:
            raise ValueError("--headless needs --data-parallel-address (where its engine cores listen)")
        if args.engine_address:
            raise ValueError("--headless engine cores listen at --data-parallel-address, not --engine-address")
        if not 1 <= args.data_parallel_rpc_port <= 65535 - local:
            raise ValueError(f"--data-parallel-rpc-port must leave room for {local} ports, got "
                             f"{args.data_parallel_rpc_port}")
        host = args.data_parallel_address
        host = f"[{host}]" if ":" in host else host
        return Placement([f"tcp://{host}:{args.data_parallel_rpc_port + rank}" for rank in range(local)], [], True)
    if local + len(remote) != data_parallel_size:
        raise ValueError(f"--dp {data_parallel_size} engine cores: {local} started here (--data-parallel-size-local) "
                         f"and {len(remote)} in --data-parallel-remote do not add up")
    if args.engine_address and local + len(remote) > 1:
        raise ValueError("--engine-address exposes one engine core; with --data-parallel-size the engine cores are "
                         "private to the gateways")
    return Placement([args.engine_address or private_ipc_address() for _ in range(local)], remote, False)
