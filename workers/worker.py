"""Worker: one rank's device, model runner and KV cache shard; sizes the cache from its memory budget."""
from __future__ import annotations


import torch

from ipc import EngineConfig, ModelRunnerOutput, SchedulerOutput
from kernels import kv_quant, start_cpu_kernels_build
from workers.cpu_allocator import available_memory, keep_freed_memory_in_heap
from workers.cpu_threads import ComputeThreads, compute_threads
from workers.device import select_device
from workers.distributed import parallel_state
from workers.gpu_memory import kv_cache_budget, profile_memory
from workers.kv_offload import HostKVTier
from workers.kv_transfer_endpoint import TransferEndpoint
from workers.layers.attention import Attention
from workers.model_config import load_hf_config, resolve_dtype
from workers.model_runner import ModelRunner
from workers.pooling.config import is_encoder, pooling_info
from workers.pooling.encoder_runner import EncoderRunner
from workers.fast_path.step_grammars import LentGrammars

_DEFAULT_CPU_KV_BYTES = 2 * 2**30
_DEFAULT_CPU_KV_FRACTION = 0.25


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = select_device(config.device)
        keep_freed_memory_in_heap()
        self.threads: ComputeThreads | None = None
        if self.device.type == "cpu":
            start_cpu_kernels_build()  # the torch paths serve until it is ready: no wait at start-up
            self.threads = compute_threads(config, parallel_state().rank)
            self.threads.adjust()  # loading and the memory profile run on this thread too
        self.hf_config = load_hf_config(config.model)
        self.encoder = is_encoder(self.hf_config)
        pooling = pooling_info(config.model, self.hf_config, config.pooler_config)
        # Encoders are small and their outputs compared to float32 references (sentence-transformers): "auto" keeps
        # them in float32 on every CPU, so an embedding is the same wherever it is computed. With bf16 GEMMs where the
        # CPU has them, MiniLM's embeddings came within cosine 0.99983 of the reference instead of 1 - 1e-12.
        self.dtype = torch.float32 if self.encoder and config.dtype == "auto" and self.device.type == "cpu" \
            else resolve_dtype(config.dtype)
        runner = EncoderRunner if self.encoder else ModelRunner
        self.model_runner = runner(config, self.hf_config, self.dtype, self.device, pooling)
        self.kv_offload: HostKVTier | None = None
        self.kv_transfer: TransferEndpoint | None = None  # disaggregated prefill's worker half

    def weight_bytes(self) -> int:
        """Bytes of this rank's model parameters and buffers as held (int8 weights count one byte each)."""
        model = self.model_runner.model
        tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # tied weights counted once
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def block_bytes(self) -> int:
        """K and V of one block over this rank's attention layers (its pipeline stage, its TP heads), and the draft
        model's on the rank that holds one."""
        layers = [m for m in self.model_runner.model.modules() if isinstance(m, Attention)]
        draft = self.model_runner.draft_model
        dtype = kv_quant.cache_dtype(self.config.kv_cache_dtype, self.dtype)
        return sum(layer.kv_block_bytes(self.config.block_size, dtype)
                   for layer in layers) + (draft.block_bytes() if draft is not None else 0)

    def determine_num_kv_blocks(self) -> int:
        """Explicit num_kv_blocks wins; else kv_cache_memory bytes; else, on CUDA, what gpu_memory_utilization
        leaves after a profiled step, and on CPU min(2 GiB, 25% of free memory), capped at what max_num_seqs
        sequences of max_model_len tokens could ever hold."""
        config = self.config
        if self.encoder:
            return 0  # attention within each step's sequences: nothing is cached
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget, source = config.kv_cache_memory, f"kv_cache_memory={config.kv_cache_memory} bytes"
        elif self.device.type == "cuda":
            budget, source = self._gpu_budget()
        else:
            budget = self._cpu_budget()
            source = f"the default CPU KV budget of {budget} bytes"
        num_blocks = max(0, budget) // self.block_bytes()
        if num_blocks < 1:
            raise ValueError(f"{source} holds no KV block (one block takes {self.block_bytes()} bytes)")
        return num_blocks

    def _cpu_budget(self) -> int:
        config = self.config
        available = available_memory()
        most_useful = config.max_num_seqs * -(-config.max_model_len // config.block_size) * self.block_bytes()
        return min(_DEFAULT_CPU_KV_BYTES, int(available * _DEFAULT_CPU_KV_FRACTION), most_useful)

    def _gpu_budget(self) -> tuple[int, str]:
        """The KV budget from profiling the largest step, and how it came about (for an error message)."""
        utilization = self.config.gpu_memory_utilization
        profile = profile_memory(self.model_runner.profile_run, self.device)
        budget = kv_cache_budget(profile, utilization)
        source = (f"gpu_memory_utilization={utilization} ({budget} bytes left of {profile.total} after a step "
                  f"peaking at {profile.torch_peak} bytes of weights and activations, and {profile.non_torch} "
                  "bytes in use outside torch; raise gpu_memory_utilization or lower max_num_batched_tokens)")
        return budget, source

    def num_host_blocks(self) -> int:
        """The blocks kv_offload_bytes holds on this rank (the prefix cache's host tier; 0 without one)."""
        if self.encoder or self.config.kv_offload_bytes is None:
            return 0
        num_blocks = self.config.kv_offload_bytes // self.block_bytes()
        if num_blocks < 1:
            raise ValueError(f"kv_offload_bytes={self.config.kv_offload_bytes} holds no KV block (one block takes "
                             f"{self.block_bytes()} bytes)")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        num_host_blocks, transfer = self.num_host_blocks(), self.config.kv_transfer_config
        if self.encoder or not (num_host_blocks or transfer is not None):
            return  # an encoder has no KV cache to copy
        runner = self.model_runner
        layers = runner.attention_layers + (runner.draft_model.attention_layers if runner.draft_model else [])
        if num_host_blocks:
            self.kv_offload = HostKVTier.for_layers(layers, num_host_blocks, self.device)
        if transfer is not None:
            self.kv_transfer = TransferEndpoint.for_layers(transfer, layers, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammars: LentGrammars | None = None) -> ModelRunnerOutput:
        if scheduler_output.kv_transfer_call is not None:  # a Ray rank's connector call: no tokens to compute
            call = scheduler_output.kv_transfer_call
            return ModelRunnerOutput(sampled_token_ids={}, kv_transfer_result=self.kv_transfer.call(call.method,
                                                                                                     call.args))
        if self.threads is not None:
            self.threads.adjust()
        if self.kv_offload is not None:
            self.kv_offload.apply(scheduler_output.kv_stores, scheduler_output.kv_loads)
        return self.model_runner.execute_model(scheduler_output, grammars)
