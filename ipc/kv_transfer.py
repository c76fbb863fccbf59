"""Disaggregated prefill's contracts (vLLM's kv_transfer_config): the connector's config, the params a prefill
engine's final output carries to the decode engine (where its prompt's KV blocks lie), and ZmqConnector's pull."""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipc.bounds import Count

# SharedMemoryConnector: both engines map one /dev/shm region (one node). ZmqConnector: the prefill engine serves its
# region's slots over TCP at kv_ip:kv_port and the decode engine pulls them (engines that share no memory).
KV_CONNECTORS = ("SharedMemoryConnector", "ZmqConnector")
# kv_both: a data-parallel group of two engines on one node, engine 0 prefills and engine 1 decodes (each engine's
# own config then names its role: kv_producer or kv_consumer).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_HOST = re.compile(r"[A-Za-z0-9_.:-]{1,253}")


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kv_connector: str
    kv_role: str
    # The shared region's size: its slots each hold one KV block (all layers' K and V) and a header.
    kv_buffer_bytes: Annotated[int, Meta(ge=1, le=2**62)] = 64 * 2**20
    # The region's file name under /dev/shm (ZmqConnector: the group's name), shared by the group's two engines: set
    # when the group is started.
    region: str | None = None
    # ZmqConnector: where the prefill engine serves its KV (loopback unless another host is given; port 0: a free one
    # picked when the group starts), how long the decode engine waits for a pull, and how long a transfer never
    # pulled holds its slots.
    kv_ip: str = "127.0.0.1"
    kv_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    kv_pull_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 5.0
    kv_hold_s: Annotated[float, Meta(gt=0, le=86400)] = 60.0


class KVTransferParams(msgspec.Struct, kw_only=True):
    """Where a prompt's KV lies: `slots[i]` holds its block i, for its first `num_tokens` tokens (whole blocks). Each
    slot's header repeats `nonce` (this transfer's), the block index and `checksum` (of those tokens' ids): the
    decode engine loads a block only where all three match, and recomputes the prompt otherwise."""

    region: str
    slots: list[Count]
    num_tokens: Count
    nonce: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    checksum: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    remote_address: str | None = None  # ZmqConnector: the prefill engine's tcp:// address, where they are pulled


class KVPull(msgspec.Struct, kw_only=True):
    """ZmqConnector, decode engine → prefill engine: a transfer's slots by its nonce (release: only free them).
    Either way the transfer ends: a slot is served once."""

    pull_id: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    nonce: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    slots: list[Count]
    release: bool = False


class KVPulled(msgspec.Struct, kw_only=True):
    """The answer to a KVPull: each slot's header words (nonce, block index, checksum), followed by one raw frame
    per KV cache holding those slots' bytes in order; or the error alone."""

    pull_id: int
    headers: list[Annotated[list[Annotated[int, Meta(ge=0, le=2**63 - 1)]], Meta(min_length=3, max_length=3)]] = []
    error: str | None = None


class KVTransferCall(msgspec.Struct, kw_only=True):
    """Engine core → every rank of an engine whose ranks are Ray actors, as a step that computes nothing: one call of
    the ranks' transfer endpoints (workers/kv_transfer_endpoint.py names those allowed), answered in
    ModelRunnerOutput.kv_transfer_result."""

    method: str
    args: list[Any] = []


def producer_address(config: KVTransferConfig, rank: int = 0) -> str:
    """Where the prefill engine's rank `rank` serves its shard of the KV (its rank 0: the group's address)."""
    host = f"[{config.kv_ip}]" if ":" in config.kv_ip else config.kv_ip
    return f"tcp://{host}:{config.kv_port + rank}"


def parse_kv_transfer_config(value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
    """A KVTransferConfig from itself, a dict (LLM's keyword) or JSON text (the CLI flag); ValueError naming the
    field at fault."""
    if value is None:
        return None
    if isinstance(value, KVTransferConfig):
        value = msgspec.structs.asdict(value)
    elif isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as error:
            raise ValueError(f"kv_transfer_config: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_config must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KVTransferConfig.__struct_fields__))
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: "
                         f"{list(KVTransferConfig.__struct_fields__)}")
    _require(value.get("kv_connector") in KV_CONNECTORS, "kv_connector",
             f"must be one of {list(KV_CONNECTORS)}, got {value.get('kv_connector')!r}")
    _require(value.get("kv_role") in KV_ROLES, "kv_role",
             f"must be one of {list(KV_ROLES)}, got {value.get('kv_role')!r}")
    region = value.get("region")
    _require(region is None or (isinstance(region, str) and _REGION_NAME.fullmatch(region) is not None), "region",
             f"must be a file name of letters, digits, '.', '_' and '-', got {region!r}")
    host = value.get("kv_ip", "127.0.0.1")
    _require(isinstance(host, str) and _HOST.fullmatch(host) is not None, "kv_ip",
             f"must be a host name or IP address, got {host!r}")
    if isinstance(value.get("kv_buffer_bytes"), str):
        from ipc.config import parse_memory_size  # config imports this module

        size = parse_memory_size(value["kv_buffer_bytes"], "kv_transfer_config.kv_buffer_bytes")
        value = {**value, "kv_buffer_bytes": size}
    try:
        return msgspec.convert(value, KVTransferConfig)
    except msgspec.ValidationError as error:
        raise ValueError(f"kv_transfer_config is invalid: {error}") from None


def _require(ok: Any, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_config.{field} {message}")
