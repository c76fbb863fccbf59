"""One rank of a tp × pp engine inside a Ray actor: joins torch.distributed, builds its Worker, runs the step loop."""
from __future__ import annotations

import os

import msgspec
import zmq

from ipc import Decoder, EngineConfig, Encoder, SchedulerOutput
from workers.device import select_device
from workers.distributed import free_port, init_distributed, parallel_state
from workers.polling import poll, poll_budget_ns
from workers.worker import Worker

# On the broadcast socket: a SchedulerOutput per step, or None (msgpack nil) to leave the loop.
Broadcast = SchedulerOutput | None
# The engine's turn between two steps (update, schedule, encode) takes 0.1-1 ms. A rank blocked in recv for it
# wakes 50-100 us late on a shared VM, and runs its step slower on cold caches: it polls this long first.
STEP_SPIN_US = int(os.environ.get("PAGEDSERVE_STEP_SPIN_US", "1000"))


class RankWorker:
    """Ray creates it with plain values only: the config arrives as msgspec JSON bytes, never a pickled object."""

    def __init__(self, config_json: bytes, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
        self.config = msgspec.json.decode(config_json, type=EngineConfig)
        self.grid = (tp_rank, tp_size, pp_rank, pp_size)
        self.worker: Worker | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def init_worker(self, host: str, port: int) -> None:
        """Rendezvous with every other rank at host:port (NCCL on CUDA, gloo on CPU), then load this rank's shard
        of the model."""
        init_distributed(host, port, *self.grid, device=select_device(self.config.device))
        self.worker = Worker(self.config)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def serve(self, broadcast_address: str, reply_address: str) -> None:
        """Execute every broadcast SchedulerOutput until None arrives; the driver rank pushes each reply."""
        context = zmq.Context()
        try:
            steps = context.socket(zmq.SUB)
            steps.setsockopt(zmq.SUBSCRIBE, b"")
            steps.connect(broadcast_address)
            replies = context.socket(zmq.PUSH) if parallel_state().is_driver else None
            if replies is not None:
                replies.connect(reply_address)
            self._step_loop(steps, replies)
        finally:
            context.destroy(linger=0)

    def _step_loop(self, steps: zmq.Socket, replies: zmq.Socket | None) -> None:
        decoder, encoder = Decoder(Broadcast), Encoder()
        # Each of the engine's ranks polls, unless together they outnumber the CPUs (counting every rank: those of
        # other stages may share this node).
        spin_ns = poll_budget_ns(STEP_SPIN_US, self.grid[1] * self.grid[3])
        while (scheduler_output := decoder.decode(receive(steps, spin_ns))) is not None:
            output = self.worker.execute_model(scheduler_output)
            if replies is not None:
                replies.send_multipart(encoder.encode(output), copy=False)


def receive(socket: zmq.Socket, spin_ns: int) -> list[zmq.Frame]:
    """The next multipart message: polled for up to spin_ns, then waited for."""
    return poll(lambda: _receive_now(socket), spin_ns) or socket.recv_multipart(copy=False)


def _receive_now(socket: zmq.Socket) -> list[zmq.Frame] | None:
    try:
        return socket.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
