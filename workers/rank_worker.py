"""One rank of a tp × pp engine inside a Ray actor: joins torch.distributed, builds its Worker, runs the step loop
(steps and replies through shared memory when the rank shares the engine's host, else through ZMQ)."""
from __future__ import annotations

import functools
import os
from typing import Callable

import msgspec
import zmq

from ipc import Decoder, EngineConfig, Encoder, SchedulerOutput
from ipc.serialization import Frame
from workers.device import select_device
from workers.distributed import free_port, init_distributed, parallel_state, set_expert_group
from workers.expert_group import join_group
from workers.polling import poll, poll_budget_ns
from workers.shm_channel import ShmChannel, attach_channel, executor_channel_paths
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
        self.step_channel: ShmChannel | None = None
        self.reply_channel: ShmChannel | None = None
        # Each of the engine's ranks polls for its next step, unless together they outnumber the CPUs (counting
        # every rank: those of other stages may share this node).
        self.spin_ns = poll_budget_ns(STEP_SPIN_US, tp_size * pp_size)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def init_worker(self, host: str, port: int) -> None:
        """Rendezvous with every other rank at host:port (NCCL on CUDA, gloo on CPU), then load this rank's shard
        of the model."""
        init_distributed(host, port, *self.grid, device=select_device(self.config.device),
                         expert_parallel=self.config.enable_expert_parallel)
        config, (tp_rank, tp_size) = self.config, self.grid[:2]
        if config.data_parallel_ep_address is not None:  # the experts split over every engine's TP ranks
            set_expert_group(join_group(config.data_parallel_ep_address, "experts",
                                        config.data_parallel_rank * tp_size + tp_rank,
                                        config.data_parallel_size * tp_size))
        self.worker = Worker(self.config)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def num_host_blocks(self) -> int:
        return self.worker.num_host_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def multi_steps(self) -> int:
        return self.worker.model_runner.multi_steps

    def attach_channels(self, name: str, step_token: bytes, reply_token: bytes) -> bool:
        """Map the engine's shared-memory channels (workers/shm_channel.py): the steps as a reader, and on the
        driver the replies as their writer. False when they are not there to map (another host): this rank then
        talks ZMQ."""
        step_paths, reply_paths = executor_channel_paths(name, self.grid[1] * self.grid[3])
        rank = parallel_state().rank
        self.step_channel = attach_channel(step_paths, step_token, rank, self.spin_ns)
        if self.step_channel is not None and parallel_state().is_driver:
            self.reply_channel = attach_channel(reply_paths, reply_token, None, 0)
            if self.reply_channel is None:
                self.step_channel.close()
                self.step_channel = None
        return self.step_channel is not None

    def serve(self, broadcast_address: str, reply_address: str) -> None:
        """Execute every broadcast SchedulerOutput until None arrives; the driver rank sends each reply."""
        context = zmq.Context()
        try:
            if self.step_channel is not None:
                receive = self.step_channel.recv
            else:
                steps = context.socket(zmq.SUB)
                steps.setsockopt(zmq.SUBSCRIBE, b"")
                steps.connect(broadcast_address)
                receive = functools.partial(receive_from, steps, self.spin_ns)
            reply = None
            if self.reply_channel is not None:
                reply = self.reply_channel.send
            elif parallel_state().is_driver:
                replies = context.socket(zmq.PUSH)
                replies.connect(reply_address)
                reply = functools.partial(replies.send_multipart, copy=False)
            self._step_loop(receive, reply)
        finally:
            context.destroy(linger=0)
            for channel in (self.step_channel, self.reply_channel):
                if channel is not None:
                    channel.close()

    def _step_loop(self, receive: Callable[[], list[Frame]], reply: Callable[[list[Frame]], None] | None) -> None:
        decoder, encoder = Decoder(Broadcast), Encoder()
        while (scheduler_output := decoder.decode(receive())) is not None:
            output = self.worker.execute_model(scheduler_output)
            if reply is not None:
                reply(encoder.encode(output))


def receive_from(socket: zmq.Socket, spin_ns: int) -> list[zmq.Frame]:
    """The next multipart message: polled for up to spin_ns, then waited for."""
    return poll(lambda: _receive_now(socket), spin_ns) or socket.recv_multipart(copy=False)


def _receive_now(socket: zmq.Socket) -> list[zmq.Frame] | None:
    try:
        return socket.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
