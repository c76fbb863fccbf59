"""EngineConfig: the engine's knobs (vLLM's names), validated on construction, sent to every worker."""
from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

from ipc.bounds import INT32_MAX, Int64, check_fields
from ipc.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from ipc.pooling import RUNNERS, PoolerConfig, parse_pooler_config
from ipc.sampling_params import NumLogprobs
from ipc.speculative import SpeculativeConfig, parse_speculative_config

Positive = Annotated[int, Meta(ge=1, le=INT32_MAX)]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Online methods quantize a plain checkpoint at load; the others name the format a checkpoint is stored in.
QUANTIZATION_METHODS = ("int8", "fp8", "compressed-tensors", "gptq", "awq", "auto-round", "gguf")
_DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
DP_ROUTING = ("prefix", "load", "round_robin")
DP_BACKENDS = ("mp", "ray")
# "auto": K/V in the model dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2": one byte per element with one scale per
# tensor (kernels/kv_quant.py says where the scales come from).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MAX_CPUS = 1024  # glibc's cpu_set_t, which pins the threads
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


class EngineConfig(msgspec.Struct, kw_only=True):
    """Engine-wide settings; `None` fields are resolved from the model or the machine at start-up."""

    model: str
    dtype: str = "auto"
    max_model_len: Positive | None = None
    max_num_seqs: Positive = 256
    max_num_batched_tokens: Positive = 2048
    # Vision-language models: the image features (placeholder tokens) whose images a step may encode; None:
    # max_num_batched_tokens. An image larger than it is encoded in a step of its own.
    max_num_encoder_input_tokens: Positive | None = None
    block_size: Annotated[int, Meta(ge=1, le=2**16)] = 16
    num_kv_blocks: Positive | None = None
    kv_cache_memory: Annotated[int, Meta(ge=1, le=2**62)] | None = None  # bytes
    # Vision-language models: the bytes of image features each first pipeline stage keeps by image hash (bytes or
    # a size like "1GiB"); None: 1 GiB (workers/encoder_cache.py).
    encoder_cache_memory: Annotated[int, Meta(ge=1, le=2**62)] | None = None
    # How K and V are stored (KV_CACHE_DTYPES): fp8 halves a block's bytes, so a budget holds twice the tokens.
    kv_cache_dtype: str = "auto"
    # Host-memory tier of the prefix cache (bytes or a size like "8GiB"): full blocks evicted from the KV cache are
    # kept there by hash and copied back on a prefix hit instead of recomputed (core/kv_offload.py); None: none.
    kv_offload_bytes: Annotated[int, Meta(ge=1, le=2**62)] | None = None
    # Disaggregated prefill (ipc/kv_transfer.py; a dict or JSON text is accepted): with data_parallel_size=2 and
    # kv_role "kv_both", engine 0 computes each prompt and hands its KV blocks over shared memory to engine 1, which
    # decodes (docs/kv-cache.md). None: every engine prefills and decodes its own requests.
    kv_transfer_config: KVTransferConfig | None = None
    seed: Int64 = 0
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=4096)] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1, le=4096)] = 1
    # Engine cores, each with its own scheduler, KV cache and workers, behind the front end; each request goes to one
    # (frontend/dp_balance.py): "prefix" where its prompt's blocks (or its cache_salt's conversation) went before
    # unless that engine is overloaded, else the least loaded; "load" by load alone; "round_robin" in turn.
    data_parallel_size: Annotated[int, Meta(ge=1, le=1024)] = 1
    data_parallel_routing: str = "prefix"
    # "mp": the engines' ranks as tensor_parallel_size / pipeline_parallel_size say (one rank in the engine process);
    # "ray": every engine's ranks are Ray actors in placement groups of its own (one rank too), on the cluster at
    # ray_address, so Ray spreads the engines over its nodes. The engine cores run where they are started.
    data_parallel_backend: str = "mp"
    # Mixture-of-experts models: each TP rank holds whole experts (a share of them) instead of a slice of every
    # expert; attention stays tensor parallel.
    enable_expert_parallel: bool = False
    # Set by the spawner for each data-parallel engine: its rank among them, and, with enable_expert_parallel, the
    # host:port where every engine's rank joins the expert-parallel group spanning them (workers/expert_group.py).
    data_parallel_rank: Annotated[int, Meta(ge=0, le=1023)] = 0
    data_parallel_ep_address: str | None = None
    # Weight quantization: None (as the checkpoint is stored), "int8" or "fp8" applied at load (per output
    # channel), or a checkpoint format (QUANTIZATION_METHODS) that must match the checkpoint's. The LM head (and an
    # embedding table tied to it) stays in the model dtype unless quantize_lm_head.
    quantization: str | None = None
    quantize_lm_head: bool = False
    # "auto": the folder's safetensors (or the GGUF file); "dummy": random weights of the config's shapes, no
    # checkpoint read (benchmarks of models too large to write out).
    load_format: str = "auto"
    # "generate", "pooling" (prefill only: embeddings, classification; no generation requests) or "auto": pooling
    # for a model without an LM head (BERT), else generate (a decoder then serves pooling requests beside).
    runner: str = "auto"
    pooler_config: PoolerConfig | None = None
    # tp * pp > 1 runs one Ray actor per rank: joins the Ray cluster here ("auto", "HOST:6379"), or, when None,
    # starts a private Ray on this machine (loopback only).
    ray_address: str | None = None
    scheduling_policy: str = "fcfs"
    # Share KV blocks between requests by content (block hashes); off: every request computes its whole prompt.
    enable_prefix_caching: bool = True
    # Past this many waiting requests the engine refuses new ones (HTTP 429); None: no limit (offline use).
    max_waiting_requests: Positive | None = None
    # "auto": CUDA when torch sees a GPU, else CPU (resolved by each worker, on its own machine).
    device: str = "auto"
    # CUDA: the fraction of the GPU's memory in use once the KV cache is allocated (weights, activations, the
    # cache itself and anything else on the device); the KV cache gets what the profiled rest leaves.
    gpu_memory_utilization: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9
    # CUDA: run every step eagerly instead of replaying CUDA graphs for decode-only batches.
    enforce_eager: bool = False
    # CUDA: decode batch sizes to capture graphs for; None: 1, 2, 4, 8, then multiples of 8 up to
    # min(max_num_seqs, 512). A decode batch is padded up to the next captured size.
    cuda_graph_sizes: Annotated[list[Positive], Meta(min_length=1)] | None = None
    # CUDA graphs: while the host turns a decode step's tokens into outputs and schedules the next step, the GPU
    # already runs the next step's forward pass for the same requests (workers/decode_ahead.py); off: the GPU
    # waits for the host between decode steps.
    decode_ahead: bool = True
    # CPU, one rank: up to this many decode steps of a decode-only batch in one worker call, when nothing waits to join
    # it and no request needs the scheduler between steps (core/multi_step.py); 1: a call per step. Its tokens reach the
    # client together, and a request that arrives meanwhile waits for the call to end.
    num_scheduler_steps: Positive = 64
    # ... and only as many of them as fit this long, by the measured time of recent steps at about that batch size
    # (core/multi_step.py's StepTimes): how long a call's tokens are held back from their streams at most, and a
    # request arriving meanwhile waits. None: always num_scheduler_steps (where allowed).
    multi_step_budget_ms: Annotated[float, Meta(gt=0.0, le=60_000.0)] | None = 100.0
    # CPU: threads of each rank's forward. None: as many as the CPUs the process may use (affinity mask, cgroup
    # quota; OMP_NUM_THREADS where set), one fewer while another process competes for them (workers/cpu_threads.py);
    # a number: always that many.
    cpu_threads: Annotated[int, Meta(ge=1, le=4096)] | None = None
    # CPU: pin the forward's threads one per CPU, in this order ("0-3,6"; with tp * pp > 1 one list per rank, in rank
    # order, joined by "|"), vLLM's VLLM_CPU_OMP_THREADS_BIND; the thread count is the list's length. None: the
    # kernel places them.
    cpu_threads_bind: str | None = None
    # The privileged utilities a client of the engine socket may call. start_profile/stop_profile only when
    # profiler_dir is set: every trace goes there, and a profile stops itself (its trace written) after
    # profiler_max_seconds or profiler_max_steps steps, which bounds its memory and its trace's size.
    profiler_dir: str | None = None
    profiler_max_seconds: Annotated[float, Meta(gt=0.0, le=3600.0)] = 60.0
    profiler_max_steps: Annotated[int, Meta(ge=1, le=100_000)] = 200
    # reset_prefix_cache only when True. LLM and AsyncLLM turn it on for the private engines they start.
    enable_cache_reset: bool = False
    # The most top alternatives a request may ask for per token (logprobs, prompt_logprobs), as vLLM's flag.
    max_logprobs: NumLogprobs = 20
    # Where the vocabulary's token strings come from, for grammars (None: the model folder).
    tokenizer: str | None = None
    # A request whose structured_outputs constraint takes longer to compile fails with an error (HTTP 400).
    structured_outputs_compile_timeout: Annotated[float, Meta(gt=0.0, le=3600.0)] = 10.0
    # Memory one compile may take beyond its worker's own (a request past it fails, HTTP 400), and the compiled
    # grammars kept for reuse.
    structured_outputs_compile_memory_mb: Annotated[int, Meta(ge=64, le=1 << 20)] = 2048
    structured_outputs_cache_mb: Annotated[int, Meta(ge=0, le=1 << 20)] = 512
    # Multi-LoRA: requests may name a PEFT adapter (LoRARequest). At most max_loras distinct adapters run in one
    # step (each holds a slot of stacked weights, rank up to max_lora_rank); max_cpu_loras adapters stay loaded.
    enable_lora: bool = False
    max_loras: Annotated[int, Meta(ge=1, le=256)] = 1
    max_lora_rank: Annotated[int, Meta(ge=1, le=512)] = 16
    max_cpu_loras: Annotated[int, Meta(ge=1, le=4096)] | None = None  # None: max_loras
    # The folders adapters may lie under, symlinks resolved (the launcher's --lora-dir and --lora-modules folders),
    # whichever client names them; None: anywhere (an engine a Python program starts for itself).
    lora_dirs: list[str] | None = None
    # Draft tokens verified by the target model in the same step (None: no speculation). A dict or JSON text is
    # accepted and converted.
    speculative_config: SpeculativeConfig | None = None
    # Requests may give their prompt as embeddings (PromptEmbeds) in place of token ids (vLLM's flag).
    enable_prompt_embeds: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        if isinstance(self.encoder_cache_memory, str):
            self.encoder_cache_memory = parse_memory_size(self.encoder_cache_memory, "encoder_cache_memory")
        if isinstance(self.kv_offload_bytes, str):
            self.kv_offload_bytes = parse_memory_size(self.kv_offload_bytes, "kv_offload_bytes")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        self.pooler_config = parse_pooler_config(self.pooler_config)
        check_fields(self)
        _require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two, got {self.block_size}")
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                 f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        _require(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _require(self.load_format in LOAD_FORMATS, "load_format",
                 f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.device in _DEVICES, "device", f"must be one of {_DEVICES}, got {self.device!r}")
        _require(self.data_parallel_routing in DP_ROUTING, "data_parallel_routing",
                 f"must be one of {DP_ROUTING}, got {self.data_parallel_routing!r}")
        _require(self.data_parallel_backend in DP_BACKENDS, "data_parallel_backend",
                 f"must be one of {DP_BACKENDS}, got {self.data_parallel_backend!r}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
                 f"must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        if self.cpu_threads_bind is not None:
            _check_cpu_threads_bind(self)
        if self.kv_transfer_config is not None:
            _check_kv_transfer(self)


def cpu_lists(text: str) -> list[list[int]]:
    """cpu_threads_bind's lists, one per rank: '0-3|4-7' → [[0, 1, 2, 3], [4, 5, 6, 7]] (Linux's cpulist format)."""
    lists = []
    for group in text.split("|"):
        cpus: list[int] = []
        seen: set[int] = set()
        for part in group.split(","):
            first, _, last = part.strip().partition("-")
            if not first.isdigit() or (last and not last.isdigit()) or not int(first) <= int(last or first) < MAX_CPUS:
                raise ValueError(f"cpu_threads_bind: not a CPU list of CPUs below {MAX_CPUS}: {group!r} "
                                 "(expected e.g. '0-3,6')")
            new = [cpu for cpu in range(int(first), int(last or first) + 1) if cpu not in seen]
            cpus += new
            seen.update(new)
        lists.append(cpus)
    return lists


def _check_cpu_threads_bind(config: EngineConfig) -> None:
    lists = cpu_lists(config.cpu_threads_bind)
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    _require(len(lists) == ranks, "cpu_threads_bind",
             f"needs one CPU list per rank ({ranks}, joined by '|'), got {len(lists)}")
    _require(config.cpu_threads is None or all(len(cpus) == config.cpu_threads for cpus in lists), "cpu_threads",
             f"must equal the length of each cpu_threads_bind list when both are given, got {config.cpu_threads}")
    _require(sum(map(len, lists)) == len(set().union(*lists)), "cpu_threads_bind", "ranks' CPU lists overlap")


def _check_kv_transfer(config: EngineConfig) -> None:
    """A connector (shared memory or ZMQ) joins two engines of one data-parallel group."""
    transfer = config.kv_transfer_config
    if transfer.kv_role == "kv_both":
        # One engine of the two: each machine's launcher (--data-parallel-size-local 1) starts its share of the group.
        split = config.data_parallel_size == 1 and transfer.kv_connector == "ZmqConnector" and transfer.kv_port != 0
        _require(config.data_parallel_size == 2 or split, "kv_transfer_config",
                 f"with kv_role 'kv_both' needs data_parallel_size=2 (a prefill and a decode engine; split over two "
                 f"machines: ZmqConnector and an explicit kv_port), got {config.data_parallel_size}")
    else:
        _require(transfer.region is not None, "kv_transfer_config",
                 f"with kv_role {transfer.kv_role!r} is one engine of a group: start the group with kv_role 'kv_both'")
    # Each rank copies its own KV shard (workers/kv_transfer_endpoint.py): the shared region is one file per engine.
    _require(transfer.kv_connector == "ZmqConnector" or (config.tensor_parallel_size * config.pipeline_parallel_size
                                                         == 1 and config.data_parallel_backend == "mp"),
             "kv_transfer_config", "with SharedMemoryConnector needs single-rank engine processes "
             "(tensor_parallel_size = pipeline_parallel_size = 1, data_parallel_backend 'mp'); ZmqConnector takes "
             "Ray-actor ranks")
    _require(config.enable_prefix_caching and config.kv_offload_bytes is None, "kv_transfer_config",
             "needs enable_prefix_caching=True and no kv_offload_bytes: the decode engine finds the transferred blocks "
             "by their hashes in its device cache")


def parse_memory_size(text: str, field: str = "kv_cache_memory") -> int:
    """'4GiB', '512 MiB', '1e9' or '2048' (bytes) → bytes (a ValueError naming `field`)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{field}: cannot parse {text!r}; use bytes or a size like '4GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
