"""RayExecutor: tp × pp RankWorker actors placed by Ray; each step's SchedulerOutput is broadcast to them.

Ray owns lifecycle only (start-up, placement, failure detection, teardown). The per-step control plane is one
message out and one back per step, no Ray call: the msgpack SchedulerOutput goes to every rank, and the last
stage's TP rank 0 (the driver) sends back the ModelRunnerOutput. Ranks on the engine's host use shared-memory
channels (workers/shm_channel.py); ranks on other nodes a ZMQ XPUB socket out and a PULL socket back.
With pp stages the engine keeps pp batches in flight: every rank runs the batches in broadcast order, so while
the last stage computes one batch the first stage already computes the next.
"""
from __future__ import annotations

import os
import secrets
import time
from collections import deque
from pathlib import Path

import msgspec
import ray
import zmq
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ipc import Decoder, EngineConfig, Encoder, ModelRunnerOutput, SchedulerOutput
from workers import shm_region
from workers.kv_transfer_endpoint import RemoteEndpoint
from workers.rank_worker import RankWorker
from workers.ray_cluster import cluster_device, connect_ray
from workers.shm_channel import ShmChannel, attach_channel, create_channel, executor_channel_paths

_PLACEMENT_TIMEOUT_S = 60.0
_SUBSCRIBE_TIMEOUT_S = 60.0
_HEALTH_POLL_MS = 100  # while waiting for a step's reply, look for dead actors this often
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class WorkerFailedError(RuntimeError):
    """A rank's actor died or its step loop raised; the engine cannot continue."""


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.max_concurrent_batches = self.pp
        self.owns_ray = not ray.is_initialized()
        # Placement group names are global to the cluster: several engines may share one.
        self.name = f"pagedserve-{secrets.token_hex(4)}"
        self.placement_groups: list[PlacementGroup] = []
        self.actors: list = []
        self.loops: list[ray.ObjectRef] = []
        self.step_channel: ShmChannel | None = None
        self.reply_channel: ShmChannel | None = None
        self.num_remote_ranks = 0
        self.context = zmq.Context()
        self.unanswered = 0  # batches submitted whose output has not been received
        self.early: deque[ModelRunnerOutput] = deque()  # received ahead of collect_output (call_step)
        try:
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self) -> None:
        if self.owns_ray:
            connect_ray(self.config.ray_address, self.tp * self.pp)
        # Every rank gets the same concrete device: "auto" means GPUs when the cluster has them.
        self.config = msgspec.structs.replace(self.config, device=cluster_device(self.config.device, self.tp * self.pp))
        self.rank_resources = {"CPU": 1, "GPU": 1} if self.config.device == "cuda" else {"CPU": 1}
        self.host = "127.0.0.1" if self.config.ray_address is None else ray.util.get_node_ip_address()
        self.placement_groups = [self._place_stage(stage) for stage in range(self.pp)]
        remote = ray.remote(num_cpus=1, num_gpus=self.rank_resources.get("GPU", 0))(RankWorker)
        config_json = msgspec.json.encode(self.config)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [_REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        self.actors = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=t),
                           runtime_env={"env_vars": env}).remote(config_json, t, self.tp, stage, self.pp)
            for stage, group in enumerate(self.placement_groups) for t in range(self.tp)]
        rendezvous_host = ray.get(self.actors[0].node_ip.remote())
        port = ray.get(self.actors[0].free_port.remote(rendezvous_host))
        self._gather([actor.init_worker.remote(rendezvous_host, port) for actor in self.actors])

    def _place_stage(self, stage: int) -> PlacementGroup:
        """One placement group per pipeline stage, STRICT_PACK: a stage's TP ranks share a node."""
        group = placement_group([self.rank_resources] * self.tp, strategy="STRICT_PACK",
                                name=f"{self.name}-pp{stage}")
        ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise WorkerFailedError(
                f"Ray could not place pipeline stage {stage}: {self.tp} ranks of {self.rank_resources} each on one "
                f"node within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.available_resources()}); add nodes or "
                "lower tensor_parallel_size")
        return group

    def determine_num_kv_blocks(self) -> int:
        """Every rank sizes its own KV shard; all of them hold the smallest count."""
        return min(self._gather([actor.determine_num_kv_blocks.remote() for actor in self.actors]))

    def weight_bytes(self) -> int:
        """Over every rank: the model's weights as held, shards and replicas alike. Before initialize_kv_cache,
        which switches the actors to their step loop."""
        return sum(self._gather([actor.weight_bytes.remote() for actor in self.actors]))

    def num_host_blocks(self) -> int:
        """Each rank's host tier holds kv_offload_bytes of its own shards; the engine uses the smallest count."""
        return min(self._gather([actor.num_host_blocks.remote() for actor in self.actors]))

    def decodes_ahead(self) -> bool:
        """Never: several ranks replay no CUDA graphs (ModelRunner._captures_cuda_graphs)."""
        return False

    def multi_steps(self) -> int:
        """What every rank runs (ModelRunner.multi_steps: the ranks run the later steps in lockstep)."""
        return self._multi_steps

    def steps_grammars(self) -> bool:
        """No: the engine core's matchers stay in its process (constrained requests take one step a call)."""
        return False

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every rank's cache, then switch the actors to the step loop."""
        self._gather([actor.initialize_kv_cache.remote(num_blocks) for actor in self.actors])
        self._multi_steps = min(self._gather([actor.multi_steps.remote() for actor in self.actors]))
        self._open_channels()
        self.broadcast = self.context.socket(zmq.XPUB)
        self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not just the first
        self.replies = self.context.socket(zmq.PULL)
        broadcast_port = self.broadcast.bind_to_random_port(f"tcp://{self.host}")
        reply_port = self.replies.bind_to_random_port(f"tcp://{self.host}")
        self.loops = [actor.serve.remote(f"tcp://{self.host}:{broadcast_port}", f"tcp://{self.host}:{reply_port}")
                      for actor in self.actors]
        self._wait_for_subscribers()
        self.encoder, self.decoder = Encoder(), Decoder(ModelRunnerOutput)

    def _open_channels(self) -> None:
        """Shared-memory channels for the ranks on this host: every rank that maps them reads its steps there,
        and the driver (if local) replies there. The files are unlinked once mapped, so nothing outlives us."""
        step_paths, reply_paths = executor_channel_paths(self.name, len(self.actors))
        try:
            step_token, reply_token = create_channel(step_paths), create_channel(reply_paths)
            if step_token is not None and reply_token is not None:
                # The engine blocks for replies rather than polling: Ray runs the ranks at nice 15, so a polling
                # engine (nice 0) would take their CPU whenever it shares one with them.
                self.step_channel = attach_channel(step_paths, step_token, None, 0)
                self.reply_channel = attach_channel(reply_paths, reply_token, 0, 0)
            if self.step_channel is None or self.reply_channel is None:
                self._close_channels()
                self.num_remote_ranks = len(self.actors)
                return
            local = self._gather([actor.attach_channels.remote(self.name, step_token, reply_token)
                                  for actor in self.actors])
        finally:
            for paths in (step_paths, reply_paths):
                shm_region.unlink(paths)
        self.step_channel.readers = [rank for rank, attached in enumerate(local) if attached]
        self.num_remote_ranks = local.count(False)
        if not local[self._driver_rank()]:
            self.reply_channel.close()
            self.reply_channel = None

    def _close_channels(self) -> None:
        for channel in (self.step_channel, self.reply_channel):
            if channel is not None:
                channel.close()
        self.step_channel = self.reply_channel = None

    def _driver_rank(self) -> int:
        """TP rank 0 of the last stage."""
        return (self.pp - 1) * self.tp

    def _wait_for_subscribers(self) -> None:
        """A PUB socket drops messages for subscribers still connecting: wait until every remote rank has
        subscribed."""
        deadline, subscribed = time.monotonic() + _SUBSCRIBE_TIMEOUT_S, 0
        while subscribed < self.num_remote_ranks:
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"only {subscribed} of {self.num_remote_ranks} remote ranks connected to "
                                        f"the step broadcast within {_SUBSCRIBE_TIMEOUT_S:.0f} s")
            if self.broadcast.poll(_HEALTH_POLL_MS):
                subscribed += self.broadcast.recv()[:1] == b"\x01"
            self.check_health()

    def submit_batch(self, scheduler_output: SchedulerOutput, grammars: None = None) -> None:
        frames = self.encoder.encode(scheduler_output)
        if self.step_channel is not None and self.step_channel.readers:
            self.step_channel.send(frames, self._while_steps_ring_full)
        if self.num_remote_ranks:
            self.broadcast.send_multipart(frames, copy=False)
        self.unanswered += 1

    def kv_transfer_endpoint(self) -> RemoteEndpoint | None:
        """The ranks' connector halves (each call a step of no tokens: call_step)."""
        return RemoteEndpoint(self) if self.config.kv_transfer_config is not None else None

    def call_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step sent behind the batches in flight, its output taken now (theirs kept, in order, for
        collect_output)."""
        self.submit_batch(scheduler_output)
        while self.unanswered > 1:
            self.early.append(self._receive())
        return self._receive()

    def _while_steps_ring_full(self) -> None:
        """The ranks free the steps ring only as they reach each step. The driver may be waiting for room in the
        replies ring before it can go on, and only we free that: read the replies ahead (both rings bounded and
        each side waiting on the other would hang), and look for dead ranks."""
        if self.reply_channel is not None:
            self.reply_channel.read_ahead()
        self.check_health()

    def collect_output(self) -> ModelRunnerOutput:
        """The oldest submitted batch's output (the driver rank replies in broadcast order)."""
        return self.early.popleft() if self.early else self._receive()

    def _receive(self) -> ModelRunnerOutput:
        self.unanswered -= 1
        if self.reply_channel is not None:
            return self.decoder.decode(self.reply_channel.recv(self.check_health))
        while not self.replies.poll(_HEALTH_POLL_MS):
            self.check_health()
        return self.decoder.decode(self.replies.recv_multipart(copy=False))

    def check_health(self) -> None:
        """Raise WorkerFailedError if any rank's step loop has ended (its actor died, or a step raised)."""
        done, _ = ray.wait(self.loops, num_returns=1, timeout=0) if self.loops else ([], [])
        if not done:
            return
        rank = self.loops.index(done[0])
        try:
            ray.get(done[0])
        except Exception as error:
            raise WorkerFailedError(f"worker rank {rank} failed: {type(error).__name__}: {error}") from error
        raise WorkerFailedError(f"worker rank {rank} left its step loop unexpectedly")

    def shutdown(self) -> None:
        """Kill the actors, remove the placement groups, and stop Ray if this executor started it."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for group in self.placement_groups:
            remove_placement_group(group)
        self.actors, self.placement_groups, self.loops = [], [], []
        self._close_channels()
        self.context.destroy(linger=0)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

    def _gather(self, refs: list[ray.ObjectRef]) -> list:
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as error:
            raise WorkerFailedError(f"a worker rank failed during start-up: {error}") from error
