"""ModelRunner: keeps per-request state, flattens one mixed prefill/decode batch, runs this rank's share of the
model (receiving from / sending to neighbouring pipeline stages), and samples on the driver rank. On CUDA the
step's index arrays go through pinned staging and decode-only batches replay CUDA graphs."""
from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from ipc import (
    EngineConfig, GrammarBitmask, ModelRunnerOutput, NewRequestData, PromptLogprobs, SamplingParams, SchedulerOutput)
from workers.cuda_graphs import DecodeBatch, DecodeGraphs, capture_sizes, padded_batch_size
from workers.distributed import Intermediate, parallel_state, pp_recv, pp_send
from workers.layers.attention import Attention, AttentionMetadata, DecodeMetadata, StepMetadata
from workers.layers.sampler import GrammarRows, Penalties, Sampler, SamplingMetadata, gather_logprobs
from workers.model_loader import load_model
from workers.pinned_staging import PinnedStaging
from workers.request_state import CachedRequestState

logger = logging.getLogger("pagedserve.model_runner")
# The memory profile samples with the costliest options (a sort over the vocabulary for each row).
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: StepMetadata
    logits_indices: torch.Tensor  # last token of each request whose scheduled tokens reach its end
    sampled_req_ids: list[str]
    prompt_logprob_jobs: list[PromptLogprobJob]


@dataclass
class PromptLogprobJob:
    """The rows of one request's prompt chunk whose next token is a prompt token (whose logprob is wanted)."""

    req_id: str
    rows: np.ndarray
    next_token_ids: list[int]
    num_top: int


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.block_size = config.block_size
        self.hidden_size: int = hf_config.hidden_size
        self.parallel = parallel_state()
        self.model = load_model(config.model, hf_config, dtype, device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed))
        self.requests: dict[str, CachedRequestState] = {}
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.staging = PinnedStaging(_staging_bytes(config), device) if device.type == "cuda" else None
        self.decode_graphs: DecodeGraphs | None = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode graphs, which write into it."""
        self._bind_kv_cache(num_blocks)
        sizes = capture_sizes(self.config)
        if sizes and self._captures_cuda_graphs():
            self.decode_graphs = DecodeGraphs(self.model, sizes, self.config.max_model_len, self.block_size,
                                              self.attention_layers[0].num_kv_heads, self.device)
            self.decode_graphs.capture()

    def _captures_cuda_graphs(self) -> bool:
        """On CUDA unless enforce_eager; single rank only, as the TP/PP collectives are not known to be
        capture-safe."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.parallel.tp_size * self.parallel.pp_size == 1)

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, kv_heads, block_size, head_dim] tensor per attention layer."""
        for layer in self.attention_layers:
            # Zeroed: never-written slots are masked out, but garbage there could hold NaN, and 0 * NaN = NaN.
            cache = torch.zeros(2, num_blocks, layer.num_kv_heads, self.block_size, layer.head_dim,
                                dtype=self.dtype, device=self.device)
            layer.kv_cache = (cache[0], cache[1])
            self.kv_caches.append(cache)

    def _release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []

    def profile_run(self) -> None:
        """The step with the largest activations, for the memory profile: max_num_batched_tokens prompt tokens
        over as many sequences as one step may sample (none longer than max_model_len), then sampling, on a
        throwaway KV cache just large enough. Leaves no request, cache or sampler state behind."""
        config = self.config
        num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        num_tokens = min(config.max_num_batched_tokens, num_seqs * config.max_model_len)
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        blocks = [-(-length // self.block_size) for length in lengths]
        first_blocks = [0, *itertools.accumulate(blocks)]
        requests = [NewRequestData(req_id=f"profile-{i}", prompt_token_ids=[0] * length,
                                   sampling_params=_PROFILE_SAMPLING, eos_token_id=None,
                                   block_ids=list(range(first_blocks[i], first_blocks[i + 1])), num_computed_tokens=0)
                    for i, length in enumerate(lengths)]
        self._bind_kv_cache(first_blocks[-1])
        try:
            self.execute_model(SchedulerOutput(
                scheduled_new_reqs=requests, scheduled_cached_reqs=[], finished_req_ids=[],
                num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in requests},
                total_num_scheduled_tokens=num_tokens))
        finally:
            self.requests.clear()
            self._release_kv_cache()
            self.sampler.generator.manual_seed(config.seed)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self._forward(inputs)
        if not self.parallel.is_last_stage:
            pp_send(hidden)
            return ModelRunnerOutput(sampled_token_ids={})
        # Every TP rank takes part in computing logits; only the driver gets them, and samples.
        prompt_logits = [self.model.compute_logits(hidden[self._tensor(job.rows)])
                         for job in inputs.prompt_logprob_jobs]
        logits = self.model.compute_logits(hidden[inputs.logits_indices]) if inputs.sampled_req_ids else None
        if not self.parallel.is_driver:
            return ModelRunnerOutput(sampled_token_ids={})
        failed: dict[str, str] = {}
        prompt_logprobs = {}
        for job, job_logits in zip(inputs.prompt_logprob_jobs, prompt_logits):
            with _fails_alone(job.req_id, failed):
                prompt_logprobs[job.req_id] = _prompt_logprobs(job_logits, job)
        rows = [row for row, req_id in enumerate(inputs.sampled_req_ids) if req_id not in failed]
        if logits is None or not rows:
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs, failed=failed)
        if len(rows) < len(inputs.sampled_req_ids):
            logits = logits[rows]
        output = self._sample(logits, [inputs.sampled_req_ids[row] for row in rows], scheduler_output.grammar_bitmask)
        output.prompt_logprobs = prompt_logprobs
        output.failed.update(failed)
        return output

    def _forward(self, inputs: ModelInputs) -> torch.Tensor | Intermediate:
        """This stage's layers; a stage after the first starts from the previous stage's hidden states."""
        if isinstance(inputs.metadata, DecodeMetadata):
            return self.decode_graphs.replay(len(inputs.input_ids))
        args = (inputs.input_ids, inputs.positions, inputs.metadata)
        if self.parallel.is_first_stage:
            return self.model(*args)
        return self.model(*args, pp_recv(self.model.num_intermediate_tensors, len(inputs.input_ids), self.hidden_size,
                                         self.dtype, self.device))

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> ModelInputs:
        if self.staging is not None:
            self.staging.begin_step()
        counts = so.num_scheduled_tokens
        # Decodes first, longest context first (the torch decode path batches rows of similar length).
        req_ids = sorted(counts, key=lambda r: (counts[r] != 1, -self.requests[r].num_computed_tokens))
        states = [self.requests[r] for r in req_ids]
        num_tokens = np.array([counts[r] for r in req_ids], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start_loc = np.concatenate(([0], np.cumsum(num_tokens)))
        seq_lens = starts + num_tokens
        row_of_token = np.repeat(np.arange(len(req_ids)), num_tokens)
        positions = np.repeat(starts - query_start_loc[:-1], num_tokens) + np.arange(query_start_loc[-1])
        input_ids = np.concatenate([s.token_ids[a:b] for s, a, b in zip(states, starts, seq_lens)])
        table = self._block_table(states)
        slot_mapping = table[row_of_token, positions // self.block_size] * self.block_size \
            + positions % self.block_size
        sampled = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        num_decodes = int((num_tokens == 1).sum())
        jobs = [job for i, state in enumerate(states)
                if (job := _prompt_logprob_job(state, int(starts[i]), int(seq_lens[i]), int(query_start_loc[i])))]
        graph_size = self._graph_size(len(req_ids)) if num_decodes == len(req_ids) and not jobs else None
        if graph_size is not None:
            batch = DecodeBatch.padded(input_ids, positions, slot_mapping, seq_lens, table, graph_size)
            input_ids_t, positions_t, metadata = self.decode_graphs.load(batch, self.staging)
        else:
            input_ids_t, positions_t = self._tensor(input_ids), self._tensor(positions)
            metadata = self._attention_metadata(slot_mapping, table, query_start_loc, seq_lens, num_decodes)
        return ModelInputs(input_ids_t, positions_t, metadata, self._tensor(query_start_loc[1:][sampled] - 1),
                           [req_ids[i] for i in sampled], jobs)

    def _graph_size(self, num_seqs: int) -> int | None:
        """The captured size a decode-only batch of num_seqs replays at; None: run it eagerly."""
        return None if self.decode_graphs is None else padded_batch_size(num_seqs, self.decode_graphs.sizes)

    def _attention_metadata(self, slot_mapping: np.ndarray, table: np.ndarray, query_start_loc: np.ndarray,
                            seq_lens: np.ndarray, num_decodes: int) -> AttentionMetadata:
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping), block_tables=self._tensor(table),
            query_start_loc=query_start_loc.tolist(), seq_lens=seq_lens.tolist(), num_decodes=num_decodes)
        if self.staging is not None:  # the kernels' int32 copies, made once for every layer
            metadata.device_query_start_loc = self.staging.to_device(query_start_loc.astype(np.int32))
            metadata.device_seq_lens = self.staging.to_device(seq_lens.astype(np.int32))
        return metadata

    def _block_table(self, states: list[CachedRequestState]) -> np.ndarray:
        table = np.zeros((len(states), max(len(s.block_ids) for s in states)), dtype=np.int64)
        for row, state in enumerate(states):
            table[row, :len(state.block_ids)] = state.block_ids
        return table

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """An int64 index array on this rank's device: shared with numpy on CPU, staged through pinned memory on
        CUDA."""
        array = np.ascontiguousarray(array, dtype=np.int64)
        return torch.from_numpy(array) if self.staging is None else self.staging.to_device(array)

    def _sample(self, logits: torch.Tensor, req_ids: list[str], bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        """Sample the batch; if that fails, sample each request alone, so that only the one at fault fails (the
        sampler leaves its inputs untouched when it raises)."""
        try:
            return self._sample_batch(logits, req_ids, bitmask)
        except Exception:
            logger.exception("sampling %d requests together failed; sampling each alone", len(req_ids))
        outputs = []
        for row, req_id in enumerate(req_ids):
            failed: dict[str, str] = {}
            with _fails_alone(req_id, failed):
                outputs.append(self._sample_batch(logits[row:row + 1], [req_id], bitmask))
            outputs.append(ModelRunnerOutput(sampled_token_ids={}, failed=failed))
        return _merged(outputs)

    def _sample_batch(self, logits: torch.Tensor, req_ids: list[str], bitmask: GrammarBitmask | None
                      ) -> ModelRunnerOutput:
        states = [self.requests[r] for r in req_ids]
        meta = self._sampling_metadata(states)
        if bitmask is not None:
            meta.grammar = _grammar_rows(bitmask, req_ids, self.device)
        out = self.sampler(logits, meta)
        logprobs = {req_ids[row]: value for row, value in out.logprobs.items()}
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(req_ids, out.token_ids)),
            logprob_token_ids={r: ids for r, (ids, _, _) in logprobs.items()},
            logprobs={r: values for r, (_, values, _) in logprobs.items()},
            sampled_ranks={r: rank for r, (_, _, rank) in logprobs.items()})

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        device = self.device
        temperature = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], device=device)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return SamplingMetadata(
            temperature=temperature,
            top_k=torch.tensor(top_k, device=device) if any(k > 0 for k in top_k) else None,
            top_p=torch.tensor(top_p, device=device) if any(p < 1.0 for p in top_p) else None,
            min_p=torch.tensor(min_p, device=device) if any(p > 0.0 for p in min_p) else None,
            generators={row: s.generator for row, s in enumerate(states) if s.generator is not None},
            banned_token_ids={row: ids for row, s in enumerate(states) if (ids := s.banned_token_ids())},
            num_logprobs={row: p.logprobs for row, p in enumerate(params) if p.logprobs is not None},
            penalties=_penalties(states, device),
            logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias} or None)


def _grammar_rows(bitmask: GrammarBitmask, req_ids: list[str], device: torch.device) -> GrammarRows | None:
    """The bitmask rows of the requests in this batch, by their row in it."""
    index = {req_id: i for i, req_id in enumerate(bitmask.req_ids)}
    rows = [row for row, req_id in enumerate(req_ids) if req_id in index]
    if not rows:
        return None
    packed = torch.frombuffer(bytearray(bitmask.packed), dtype=torch.int32).view(-1, bitmask.words_per_row)
    return GrammarRows(rows, packed[[index[req_ids[row]] for row in rows]].to(device))


@contextlib.contextmanager
def _fails_alone(req_id: str, failed: dict[str, str]) -> Iterator[None]:
    """Record an exception in the block as this request's failure instead of letting it end the step."""
    try:
        yield
    except Exception as error:
        logger.exception("request %s failed", req_id)
        failed[req_id] = f"{type(error).__name__}: {error}"


def _merged(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput(sampled_token_ids={})
    for output in outputs:
        for name in ("sampled_token_ids", "logprob_token_ids", "logprobs", "sampled_ranks", "failed"):
            getattr(merged, name).update(getattr(output, name))
    return merged


def _prompt_logprobs(logits: torch.Tensor, job: PromptLogprobJob) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)
    next_token_ids = torch.tensor(job.next_token_ids, device=logits.device)
    return PromptLogprobs(*gather_logprobs(logprobs, next_token_ids, job.num_top))


def _prompt_logprob_job(state: CachedRequestState, start: int, end: int, first_row: int) -> PromptLogprobJob | None:
    """Positions start..end-1 of this step; each one before the prompt's last predicts a prompt token. Once a
    token was sampled they were all reported (a preempted request recomputes its prompt without them)."""
    num_top = state.sampling_params.prompt_logprobs
    last = min(end, state.num_prompt_tokens - 1)
    if num_top is None or state.num_output_tokens or last <= start:
        return None
    return PromptLogprobJob(state.req_id, np.arange(first_row, first_row + last - start),
                            state.token_ids[start + 1:last + 1], num_top)


def _penalties(states: list[CachedRequestState], device: torch.device) -> Penalties | None:
    rows = [row for row, state in enumerate(states) if state.sampling_params.has_penalties]
    if not rows:
        return None
    params = [states[row].sampling_params for row in rows]
    return Penalties(rows=rows, presence=torch.tensor([p.presence_penalty for p in params], device=device),
                     frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
                     repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
                     output_token_ids=[states[row].token_ids[states[row].num_prompt_tokens:] for row in rows],
                     seen_token_ids=[states[row].token_ids for row in rows])


def _staging_bytes(config: EngineConfig) -> int:
    """Pinned bytes for the most one step stages, each array aligned: four int64 arrays indexed by token (ids,
    positions, slots, prompt-logprob rows; a padded decode batch may exceed the token budget, never max_num_seqs),
    the block table, the logits indices, and the int32 query starts and lengths."""
    rows, seqs = max(config.max_num_batched_tokens, config.max_num_seqs), config.max_num_seqs
    table = seqs * -(-config.max_model_len // config.block_size)
    return 8 * (4 * rows + table + seqs) + 4 * (2 * seqs + 1) + 16 * (seqs + 8)
