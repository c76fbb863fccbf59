"""Disaggregated prefill, engine-core (scheduler) half: between steps, a finished prefill's whole prompt blocks are
given slots of the transfer region (from a free list, else the least recently written one reused) and a nonce, and a
decode request's blocks are loaded from it into fresh blocks of the prefix cache (shared memory: as it is first
scheduled; ZmqConnector: pulled from the prefill engine's while the loop steps the running requests, at the step
boundary after its answer came), where its admission finds them by its own hashes. The copies and sockets are the
workers' (workers/kv_transfer_endpoint.py: each rank its own KV shard); this half decides, by metadata alone."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ipc import EngineConfig
from ipc.kv_transfer import KVTransferConfig, KVTransferParams, producer_address
from ipc.sockets import free_tcp_address
from workers.shm_region import SHM_DIR

if TYPE_CHECKING:  # the front end's start-up imports this module for its last two functions: no torch there
    from core.kv_cache_manager import KVCacheManager
    from core.request import Request
    from workers.kv_transfer_endpoint import RemoteEndpoint, TransferEndpoint

    Endpoint = TransferEndpoint | RemoteEndpoint


class KVConnector:
    def __init__(self, role: str, name: str, endpoint: Endpoint, kv: KVCacheManager) -> None:
        self.role, self.name, self.endpoint, self.kv = role, name, endpoint, kv
        self.num_slots = endpoint.num_slots()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.written: OrderedDict[int, None] = OrderedDict()  # slots holding a transfer, least recently written first
        self.blocks_sent = self.blocks_received = self.recomputes = 0

    def send(self, request: Request) -> KVTransferParams | None:
        """A prefill engine's finished produce_kv request, before its blocks go back to the pool: its prompt's whole
        blocks (bar the one holding its last token, which the decode engine computes to sample) into slots."""
        if self.role != "kv_producer" or not request.produce_kv:
            return None
        block_ids = self.kv.block_ids(request)
        num_blocks = min((len(request.prompt_token_ids) - 1) // self.kv.block_size, len(block_ids),
                         self.num_slots)
        if num_blocks <= 0:
            return None
        num_tokens = num_blocks * self.kv.block_size
        slots, nonce = self._take_slots(num_blocks), 1 + secrets.randbelow(2**63 - 1)
        checksum = token_checksum(request.prompt_token_ids[:num_tokens])
        self.endpoint.save(block_ids[:num_blocks], slots, nonce, checksum)
        self.blocks_sent += num_blocks
        return KVTransferParams(region=self.name, slots=slots, num_tokens=num_tokens, nonce=nonce, checksum=checksum)

    def pull(self, request: Request) -> bool:
        """Whether a decode engine's new request waits for its KV to arrive before it may be scheduled (ZmqConnector);
        shared memory holds it already, loaded when the request is first scheduled."""
        return False

    def arrived(self) -> list[Request]:
        """The requests whose pull ended since (their KV arrived, or they compute it), to be scheduled."""
        return []

    def forget(self, request: Request) -> None:
        """The request ended (e.g. aborted while its KV was arriving): its pull, if any, is dropped."""

    def wait(self, timeout_s: float) -> None:
        """Until a pull may end, at most timeout_s (none to wait for here)."""

    def receive(self, request: Request) -> None:
        """A decode engine's request as it is first scheduled: its transferred blocks that the prefix cache lacks,
        loaded and cached there; any check failing (another group's params, other tokens, a slot overwritten or
        missing) leaves them to be computed."""
        params, request.kv_transfer_params = request.kv_transfer_params, None
        if self.role != "kv_consumer" or params is None:
            return
        if not self._valid(request, params):
            self.recomputes += 1
            return
        self._cache(request, params, functools.partial(self._load, params))

    def _cache(self, request: Request, params: KVTransferParams, load: Callable[[int, list[int]], bool]) -> None:
        """The transferred blocks the prefix cache lacks, loaded by load(first block index, fresh block ids) and
        cached there, where the request's admission finds them."""
        loaded = self.kv.cache_loaded(request, self._num_blocks(request, params), load)
        if loaded is False:
            self.recomputes += 1
        elif loaded:
            self.blocks_received += loaded
        else:  # the prefix cache held them already (or too few blocks were free): the slots are not needed
            self._release(params)

    def close(self) -> None:
        self.endpoint.close()

    def _valid(self, request: Request, params: KVTransferParams) -> bool:
        """From this group's producer, whole blocks, and the request's own tokens."""
        return self._from_here(params) and params.num_tokens == len(params.slots) * self.kv.block_size and \
            params.checksum == token_checksum(request.prompt_token_ids[:params.num_tokens])

    def _num_blocks(self, request: Request, params: KVTransferParams) -> int:
        """The transfer's blocks the request uses: not the one holding its last token (computed to sample)."""
        return min(len(params.slots), (request.num_tokens - 1) // self.kv.block_size)

    def _from_here(self, params: KVTransferParams) -> bool:
        return params.region == self.name and params.remote_address is None

    def _load(self, params: KVTransferParams, first: int, block_ids: list[int]) -> bool:
        """The transfer's blocks first.. into block_ids, verified by the region's headers."""
        return self.endpoint.load(params.slots[first:first + len(block_ids)], block_ids, params.nonce,
                                  params.checksum, first)

    def _release(self, params: KVTransferParams) -> None:
        self.endpoint.release(params.slots, params.nonce)

    def _take_slots(self, count: int) -> list[int]:
        """`count` slots: released ones first, then those written longest ago (a decode engine that has not read
        one yet finds it overwritten and recomputes)."""
        for slot in self.endpoint.released(list(self.written)):
            del self.written[slot]
            self.free_slots.append(slot)
        while len(self.free_slots) < count:
            self.free_slots.append(self.written.popitem(last=False)[0])
        slots = [self.free_slots.pop() for _ in range(count)]
        self.written.update(dict.fromkeys(slots))
        return slots


class ZmqConnector(KVConnector):
    """The prefill engine serves its (private) region's slots over ZMQ; the decode engine pulls a transfer's slots as
    the request arrives, without waiting: the request waits outside the scheduler's queue until the answer comes (or
    kv_pull_timeout_s passes), while the loop steps the running requests. At the next step boundary the answer goes
    through its own region, where the same headers are checked as with shared memory (TransferRegion.read), into
    the prefix cache, and the request joins the queue."""

    def __init__(self, config: KVTransferConfig, endpoint: Endpoint, kv: KVCacheManager) -> None:
        super().__init__(config.kv_role, config.region, endpoint, kv)
        self.address = producer_address(config)
        self.pulling: dict[int, tuple[Request, int]] = {}  # pull id → (its request, the transfer's first block pulled)
        self.pull_of: dict[str, int] = {}  # request id → its pull in flight

    def send(self, request: Request) -> KVTransferParams | None:
        params = super().send(request)
        return None if params is None else msgspec.structs.replace(params, remote_address=self.address)

    def pull(self, request: Request) -> bool:
        params = request.kv_transfer_params
        if self.role != "kv_consumer" or params is None:
            return False
        valid = self._valid(request, params)
        first, num_blocks = len(self.kv.computed_blocks(request)), self._num_blocks(request, params)
        if valid and first >= num_blocks:  # the prefix cache holds them: the transfer's slots go back now
            self.endpoint.release_remote(params.nonce, params.slots)
            request.kv_transfer_params = None
            return False
        pull_id = self.endpoint.start_pull(params.nonce, params.slots[first:num_blocks]) if valid else None
        if pull_id is None:
            self.recomputes += 1
            request.kv_transfer_params = None
            return False
        self.pulling[pull_id] = (request, first)
        self.pull_of[request.request_id] = pull_id
        return True

    def arrived(self) -> list[Request]:
        """Each answer is loaded into the prefix cache at once (the step boundary), so what waits for the request's
        admission is bounded by the KV cache, not held in host memory."""
        requests = []
        for pull_id, answered in self.endpoint.poll() if self.pulling else ():
            request, first = self.pulling.pop(pull_id)
            del self.pull_of[request.request_id]
            params, request.kv_transfer_params = request.kv_transfer_params, None
            if not answered:
                self.recomputes += 1
            else:
                self._cache(request, params, functools.partial(self._load_answer, params, pull_id, first))
            requests.append(request)
        return requests

    def forget(self, request: Request) -> None:
        pull_id = self.pull_of.pop(request.request_id, None)
        if pull_id is not None:
            del self.pulling[pull_id]
            self.endpoint.cancel(pull_id)

    def wait(self, timeout_s: float) -> None:
        if self.pulling:
            self.endpoint.wait(timeout_s)

    def _from_here(self, params: KVTransferParams) -> bool:
        return params.region == self.name and params.remote_address == self.address  # never pulled from elsewhere

    def _load_answer(self, params: KVTransferParams, pull_id: int, pulled_first: int, first: int,
                     block_ids: list[int]) -> bool:
        """The pull's answered blocks first.. (it holds those from pulled_first on) into block_ids."""
        return first >= pulled_first and self.endpoint.load_answer(pull_id, first - pulled_first, block_ids,
                                                                   params.nonce, params.checksum, first)

    def _release(self, params: KVTransferParams) -> None:
        """Nothing to tell the producer: the pull ended the transfer there (those needed by none: pull())."""


def make_connector(config: KVTransferConfig, endpoint: Endpoint, kv: KVCacheManager) -> KVConnector:
    if config.kv_role == "kv_both":
        raise ValueError("kv_transfer_config: kv_role 'kv_both' names a group of two engines, and this one was started "
                         "alone: use data_parallel_size=2, or a launcher per machine (--data-parallel-size-local 1)")
    if config.kv_connector == "ZmqConnector":
        return ZmqConnector(config, endpoint, kv)
    return KVConnector(config.kv_role, config.region, endpoint, kv)


def token_checksum(token_ids: list[int]) -> int:
    digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: msgspec's bounds fit an int64


def transfer_group_configs(configs: list[EngineConfig], first_rank: int = 0) -> list[EngineConfig]:
    """A kv_both group's engines started here, the group's ranks first_rank..: rank 0 the producer, rank 1 the
    consumer, sharing a fresh region name (ZmqConnector: a free port). A group split over machines (one engine here)
    needs ZmqConnector and the kv_port both machines' launchers are given, which also names the group."""
    transfer = configs[0].kv_transfer_config if configs else None
    if transfer is None or transfer.kv_role != "kv_both":
        return configs
    name, port = f"pagedserve-kv-{os.getpid()}-{secrets.token_hex(8)}", transfer.kv_port
    if len(configs) < 2:  # EngineConfig has checked: ZmqConnector at the kv_port both machines are given
        name = f"pagedserve-kv-{port}"
    elif transfer.kv_connector == "ZmqConnector" and port == 0:
        port = int(free_tcp_address(transfer.kv_ip).rsplit(":", 1)[1])
    roles = ("kv_producer", "kv_consumer")[first_rank:]
    return [msgspec.structs.replace(config, kv_transfer_config=msgspec.structs.replace(
        transfer, kv_role=role, region=name, kv_port=port)) for config, role in zip(configs, roles)]


def remove_region(configs: list[EngineConfig]) -> None:
    """The region's name, once every engine has mapped it (at start-up): no file outlives them, even killed."""
    names = {config.kv_transfer_config.region for config in configs if config.kv_transfer_config is not None}
    for name in names - {None}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
