"""One rank of a tp × pp engine inside a Ray actor: joins torch.distributed, builds its Worker, runs the step loop."""
from __future__ import annotations

import msgspec
import zmq

from ipc import Decoder, EngineConfig, Encoder, SchedulerOutput
from workers.device import select_device
from workers.distributed import free_port, init_distributed, parallel_state
from workers.worker import Worker

# On the broadcast socket: a SchedulerOutput per step, or None (msgpack nil) to leave the loop.
Broadcast = SchedulerOutput | None


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
        while (scheduler_output := decoder.decode(steps.recv_multipart(copy=False))) is not None:
            output = self.worker.execute_model(scheduler_output)
            if replies is not None:
                replies.send_multipart(encoder.encode(output), copy=False)
