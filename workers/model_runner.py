"""ModelRunner: keeps per-request state, flattens one mixed prefill/decode batch, runs this rank's share of the
model (receiving from / sending to neighbouring pipeline stages), and samples on the driver rank. On CUDA the
step's index arrays go through pinned staging and decode-only batches replay CUDA graphs."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PretrainedConfig

from ipc import (EngineConfig, ModelRunnerOutput, NewRequestData, PoolingInfo, PromptLogprobs, SamplingParams,
                 SchedulerOutput)
from kernels.cpu_greedy_decode import SampledRows
from kernels.gemv_choice import GemvChoice
from workers.cuda_graphs import DecodeBatch, DecodeGraphs, capture_sizes, padded_batch_size
from workers.decode_ahead import AheadForward, DecodeRows, next_rows
from workers.distributed import Intermediate, parallel_state, pp_recv, pp_send
from workers.gemv_tuning import choose_gemvs
from workers.later_steps import LaterSteps, StepBatch, accepted_run
from workers.layers.attention import Attention, AttentionMetadata, DecodeMetadata, StepMetadata
from workers.layers.fused_moe import FusedMoE
from workers.layers.sampler import Sampler, gather_logprobs
from workers.lora.manager import LoRAManager
from workers.model_loader import load_model
from workers.pinned_staging import PinnedStaging
from workers.pooling.pooler import ChunkedPooling, finish_embedding
from workers.request_state import CachedRequestState
from workers.spec_decode import DraftModel, make_speculator
from workers.step_sampling import SampleGroup, StepSampler, fails_alone, penalized_rows

logger = logging.getLogger("pagedserve.model_runner")
# The memory profile samples with the costliest options (a sort over the vocabulary for each row).
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: StepMetadata
    # Rows to sample: the last token of each request whose scheduled tokens reach its end, and the drafts before it
    logits_indices: torch.Tensor
    sample_groups: list[SampleGroup]
    prompt_logprob_jobs: list[PromptLogprobJob]
    lora_row_slots: list[int] | None = None  # the adapter slot of each row of logits_indices (workers.lora)
    pooling_jobs: list[PoolingJob] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # the step's final hidden states where a forward pass ahead computed them


@dataclass
class PoolingJob:
    """A pooling request's rows in this step: `count` rows from `first_row`, its prompt positions from `start`."""

    state: CachedRequestState
    first_row: int
    count: int
    start: int
    is_last: bool


@dataclass
class PromptLogprobJob:
    """The rows of one request's prompt chunk whose next token is a prompt token (whose logprob is wanted)."""

    req_id: str
    rows: np.ndarray
    next_token_ids: list[int]
    num_top: int
    lora_slot: int = -1


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device, pooling: PoolingInfo) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.block_size = config.block_size
        self.hidden_size: int = hf_config.hidden_size
        self.parallel = parallel_state()
        self.model = load_model(config.model, hf_config, dtype, device, config.quantization, config.quantize_lm_head,
                                config.load_format)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed))
        self.step_sampler = StepSampler(self.sampler, device)
        # Only the driver samples, so only it proposes drafts (and holds a draft model).
        self.speculator = make_speculator(config.speculative_config, dtype, device, self.block_size,
                                          config.max_model_len, self.sampler) if self.parallel.is_driver else None
        self.requests: dict[str, CachedRequestState] = {}
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.staging = PinnedStaging(_staging_bytes(config), device) if device.type == "cuda" else None
        self.decode_graphs: DecodeGraphs | None = None
        # Decode ahead (workers/decode_ahead.py): the rows the sampling of this step launches the next forward pass
        # for, with the graph size, and the forward pass last launched, until the next step takes or drops it.
        self.ahead_plan: tuple[DecodeRows, int] | None = None
        self.ahead: AheadForward | None = None
        self.ahead_hits = 0  # decode steps whose forward pass ran ahead
        self.gemv_choices: list[GemvChoice] = []  # what start-up timing chose for one-row products (CUDA)
        self.lora = LoRAManager(self.model, config, dtype, device) if config.enable_lora else None
        self.pooling = pooling
        self.chunked_pooling = ChunkedPooling(pooling.pooling_type)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode graphs, which write into it. Before a graph of one row
        is captured, its products are chosen (timed on the GPU while it is otherwise idle); only then, as the
        Triton GEMV's launches cost more host time than cuBLAS's: the graph's replay makes its layers' launches
        free, and the LM head's, outside it, is one launch a step."""
        self._bind_kv_cache(num_blocks)
        sizes = capture_sizes(self.config)
        if sizes and self._captures_cuda_graphs():
            if sizes[0] == 1:
                self.gemv_choices = choose_gemvs(self.model)
            self.decode_graphs = DecodeGraphs(self.model, sizes, self.config.max_model_len, self.block_size,
                                              self.attention_layers[0].num_kv_heads, self.device)
            self.decode_graphs.capture()

    def _captures_cuda_graphs(self) -> bool:
        """On CUDA unless enforce_eager; single rank only, as the TP/PP collectives are not known to be
        capture-safe; no mixture of experts, whose fused kernel sizes its grid from the step's routing on the host."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.parallel.tp_size * self.parallel.pp_size == 1
                and not any(isinstance(m, FusedMoE) for m in self.model.modules()))

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """One cache tensor per attention layer (Attention.bind_kv_cache)."""
        for layer in self.attention_layers:
            self.kv_caches.append(layer.bind_kv_cache(num_blocks, self.block_size, self.dtype, self.device))
        if self.draft_model is not None:
            self.draft_model.bind_kv_cache(num_blocks)

    def _release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        if self.draft_model is not None:
            self.draft_model.bind_kv_cache(None)

    @property
    def decodes_ahead(self) -> bool:
        """Whether decode steps' forward passes run ahead: CUDA graphs captured, no draft tokens to propose."""
        return self.decode_graphs is not None and self.config.decode_ahead and self.speculator is None

    @property
    def multi_steps(self) -> int:
        """The most decode steps one call runs (core/multi_step.py): on the CPU of a single rank only (CUDA
        graphs and decode ahead take that cost off the GPU's path). With speculative decoding, each step verifies
        the drafts proposed after the one before."""
        if (self.device.type != "cpu" or self.decode_graphs is not None
                or self.parallel.tp_size * self.parallel.pp_size > 1):
            return 1
        return self.config.num_scheduler_steps

    @property
    def draft_model(self) -> DraftModel | None:
        return self.speculator.proposer if self.speculator and isinstance(self.speculator.proposer, DraftModel) \
            else None

    def profile_run(self) -> None:
        """The step with the largest activations, for the memory profile: max_num_batched_tokens prompt tokens
        over as many sequences as one step may sample (none longer than max_model_len), then sampling, on a
        throwaway KV cache just large enough. Leaves no request, cache or sampler state behind."""
        config = self.config
        num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        num_tokens = min(config.max_num_batched_tokens, num_seqs * config.max_model_len)
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        # Slots for the drafts a draft model writes after the sampled token: its steps are profiled too.
        drafted = config.speculative_config.num_speculative_tokens if self.speculator is not None else 0
        blocks = [-(-(length + drafted) // self.block_size) for length in lengths]
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
            if self.speculator is not None:
                for request in requests:
                    self.speculator.forget(request.req_id)
            self.requests.clear()
            self._release_kv_cache()
            self.sampler.generator.manual_seed(config.seed)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        ahead, self.ahead, self.ahead_plan = self.ahead, None, None  # a step ahead serves the next step only
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output, ahead)
        hidden = self._forward(inputs)
        if not self.parallel.is_last_stage:
            pp_send(hidden)
            return ModelRunnerOutput(sampled_token_ids={})
        # Every TP rank takes part in computing logits; only the driver gets them, and samples.
        prompt_logits = [self._logits(hidden[self._tensor(job.rows)], [job.lora_slot] * len(job.rows))
                         for job in inputs.prompt_logprob_jobs]
        logits = self._logits(hidden[inputs.logits_indices], inputs.lora_row_slots) if inputs.sample_groups \
            else None
        if not self.parallel.is_driver:
            return ModelRunnerOutput(sampled_token_ids={})
        failed: dict[str, str] = {}
        pooled = self._pool(hidden, inputs.pooling_jobs, failed)
        prompt_logprobs = {}
        for job, job_logits in zip(inputs.prompt_logprob_jobs, prompt_logits):
            with fails_alone(job.req_id, failed):
                prompt_logprobs[job.req_id] = _prompt_logprobs(job_logits, job)
        groups = [group for group in inputs.sample_groups if group.state.req_id not in failed]
        if logits is None or not groups:
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs, failed=failed,
                                     pooled=pooled)
        if len(groups) < len(inputs.sample_groups):
            logits = logits[_rows_of(inputs.sample_groups, failed)]
        output = self.step_sampler.sample(logits, groups, scheduler_output.grammar_bitmask,
                                          self._launch_ahead if self.ahead_plan is not None else None)
        if self.ahead is not None:
            self.ahead.token_ids = np.array([output.sampled_token_ids.get(req_id, [-1])[-1]
                                             for req_id in self.ahead.rows.req_ids], dtype=np.int64)
        output.prompt_logprobs, output.pooled = prompt_logprobs, pooled
        output.failed.update(failed)
        sampled = output.sampled_token_ids
        output.verified = {group.state.req_id: [(len(group.drafts), len(sampled[group.state.req_id]) - 1)]
                           for group in groups if group.drafts and group.state.req_id in sampled}
        if scheduler_output.num_steps > 1 and not output.failed:
            self._decode_more(output, [group.state for group in groups], scheduler_output.num_steps)
        else:
            output.draft_token_ids = self._propose(output)
        return output

    def _propose(self, output: ModelRunnerOutput, states: list[CachedRequestState] | None = None
                 ) -> dict[str, list[int]]:
        """Drafts to verify next, after the tokens sampled so far (none without speculative decoding); for `states`
        only if given."""
        if self.speculator is None:
            return {}
        return self.speculator.propose(self.requests, output.sampled_token_ids,
                                       None if states is None else [state.req_id for state in states])

    def _decode_more(self, output: ModelRunnerOutput, states: list[CachedRequestState], num_steps: int) -> None:
        """A multi-step call's steps after the first, into the slots the scheduler allocated ahead: each feeds every
        request its last token and the drafts proposed after it (speculative decoding); the accepted drafts and one
        more token (the argmax, or sampled as in any step, over the call's tokens so far) are appended to `output`,
        with the verification. Ends early once no request can go on (workers.later_steps). The drafts proposed
        after the last step go with the output."""
        steps = LaterSteps(states, [output.sampled_token_ids[s.req_id] for s in states], *self._block_table(states),
                            self.block_size, self.config.max_model_len)
        draft_ahead = self.draft_model.num_drafts if self.draft_model is not None else 0
        argmax_only = all(state.sampling_params.logits_as_they_are and state.sampling_params.is_greedy
                          for state in states)
        in_one_call = all(state.sampling_params.reports_no_logprobs_or_bans for state in states) and \
            self._in_one_call(steps, num_steps - 1, output)
        for _ in range(1, 1 if in_one_call else num_steps):
            rows = steps.active()
            if not rows:
                break
            proposed = self._propose(output, [states[i] for i in steps.with_room(rows, draft_ahead)])
            batch = steps.batch(rows, {i: proposed[states[i].req_id] for i in rows if states[i].req_id in proposed})
            metadata = self._attention_metadata(batch.slot_mapping, batch.block_table, batch.query_start_loc,
                                                batch.seq_lens, batch.num_decodes)
            feeds = np.array([len(feed) for feed in batch.feeds])
            slots = self._lora_slots([states[i] for i in batch.rows], feeds)  # each token's adapter, if any
            hidden = self._forward(ModelInputs(self._tensor(batch.input_ids), self._tensor(batch.positions), metadata,
                                               self._tensor(np.arange(len(batch.input_ids))), [], []))
            logits = self._logits(hidden, np.repeat(slots, feeds).tolist())
            if argmax_only:  # as the sampler takes a plain greedy row
                argmax = logits.argmax(dim=-1).tolist()
                runs = [accepted_run(feed[1:], argmax[first:first + len(feed)])
                        for feed, first in zip(batch.feeds, batch.query_start_loc)]
            else:
                runs = self._sample_later_step(logits, steps, batch, output)
            for i, feed, run in zip(batch.rows, batch.feeds, runs):
                if run is None:
                    steps.stop(i)
                    continue
                steps.take(i, run)
                if len(feed) > 1:
                    output.verified.setdefault(states[i].req_id, []).append((len(feed) - 1, len(run) - 1))
        output.draft_token_ids = self._propose(output, [states[i] for i in steps.with_room(range(len(states)),
                                                                                            draft_ahead)])

    def _sample_later_step(self, logits: torch.Tensor, steps: LaterSteps, batch: StepBatch,
                           output: ModelRunnerOutput) -> list[list[int] | None]:
        """Each row's tokens from the sampler (its accepted drafts and the token after them; None where its sampling
        failed, recorded in `output`): sampled, penalized and banned over its tokens and the call's so far; the
        logprobs of those that ask, after those of the call's earlier tokens in `output`."""
        groups = [self._sample_group(steps.states[i], feed[1:], steps.tokens[i]) for i, feed in zip(batch.rows,
                                                                                                     batch.feeds)]
        sampled = self.step_sampler.sample(logits, groups, None)
        output.failed.update(sampled.failed)
        for req_id, token_ids in sampled.logprob_token_ids.items():
            output.logprob_token_ids.setdefault(req_id, []).extend(token_ids)
            output.logprobs.setdefault(req_id, []).extend(sampled.logprobs[req_id])
            output.sampled_ranks.setdefault(req_id, []).extend(sampled.sampled_ranks[req_id])
        return [sampled.sampled_token_ids.get(group.state.req_id) for group in groups]

    def _in_one_call(self, steps: LaterSteps, count: int, output: ModelRunnerOutput) -> bool:
        """Up to `count` steps of the active requests (no logprobs, no bad words) in one call of the model's
        greedy_decode (where it has one that takes them), drawing sampled requests' tokens as the sampler would (from
        logits biased and penalized as it processes them) and verifying the drafts the speculator would propose,
        which the kernel writes itself (prompt lookup's, or a draft model's; sampled or penalized requests verify
        theirs in Python), the tokens taken into `steps`, failures and verifications into `output`; whether it
        ran."""
        greedy = getattr(self.model, "greedy_decode", None)
        rows = steps.active()
        if greedy is None or self.lora is not None or not rows:
            return False
        drafts = None
        states = [steps.states[i] for i in rows]
        sampled = not all(state.sampling_params.is_greedy for state in states)
        processed = not all(state.sampling_params.logits_as_they_are for state in states)
        if self.speculator is not None and self.speculator.speculates(len(output.sampled_token_ids)):
            if sampled or processed or (drafts := self.speculator.kernel_drafts(
                    states, [state.token_ids + steps.tokens[i] for state, i in zip(states, rows)],
                    steps.capacity[rows])) is None:
                return False
        limits = steps.limits(rows)
        run = greedy(np.array([steps.tokens[i][-1] for i in rows], dtype=np.int64), steps.context[rows] - 1,
                     steps.table[rows], limits, [steps.stops[i] for i in rows], count, drafts,
                     self._sampled_rows(states, limits, count) if sampled else None,
                     penalized_rows(states, [steps.tokens[i] for i in rows]) if processed else None)
        if run is None:
            return False
        for i, row, failed in zip(rows, run.tokens, run.failed):
            steps.take(i, row[row >= 0].tolist())
            if failed:
                output.failed[steps.states[i].req_id] = "no token to sample: every logit is -inf, or one is NaN"
                steps.stop(i)
        if drafts is not None:
            self.speculator.resume(states, drafts, steps.context[rows])
        if run.verified is not None:
            for i, checks in zip(rows, run.verified):
                checks = checks[checks[:, 0] >= 0]
                if len(checks):
                    output.verified.setdefault(steps.states[i].req_id, []).extend(map(tuple, checks.tolist()))
        return True

    def _sampled_rows(self, states: list[CachedRequestState], limits: np.ndarray, count: int) -> SampledRows:
        """The requests' sampling options and uniform draws for up to `count` steps, drawn as the sampler draws them
        step by step: a seeded request's one per step it may take from its own generator, the others' from the
        shared one (float32, as the sampler's)."""
        params = [state.sampling_params for state in states]
        uniform = torch.empty(len(states), count).uniform_(generator=self.sampler.generator).double()
        for row, (state, limit) in enumerate(zip(states, limits.tolist())):
            if state.generator is not None and not state.sampling_params.is_greedy:
                uniform[row, :min(count, limit)] = torch.empty(min(count, limit)).uniform_(generator=state.generator)
        return SampledRows(np.array([0.0 if p.is_greedy else p.temperature for p in params], dtype=np.float32),
                           np.array([p.top_k for p in params], dtype=np.int64),
                           np.array([p.top_p for p in params], dtype=np.float32),
                           np.array([p.min_p for p in params], dtype=np.float32), uniform.numpy())

    def _pool(self, hidden: torch.Tensor, jobs: list[PoolingJob], failed: dict[str, str]) -> dict[str, bytes]:
        """The pooled results of the pooling requests whose prompt this step completed."""
        pooled = {}
        for job in jobs:
            with fails_alone(job.state.req_id, failed):
                rows = hidden[job.first_row:job.first_row + job.count]
                vector = self.chunked_pooling.add(job.state.req_id, rows, job.start, job.is_last)
                if vector is not None:
                    pooled[job.state.req_id] = finish_embedding(vector, job.state.pooling_params, self.pooling)
        return pooled

    def _logits(self, hidden: torch.Tensor, lora_slots: list[int] | None) -> torch.Tensor | None:
        if self.lora is not None:
            self.lora.set_row_slots(lora_slots or [])
        return self.model.compute_logits(hidden)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor | Intermediate:
        """This stage's layers; a stage after the first starts from the previous stage's hidden states."""
        if inputs.hidden is not None:
            return inputs.hidden
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
            self.chunked_pooling.forget(req_id)
            if self.speculator is not None:
                self.speculator.forget(req_id)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                if self.speculator is not None:
                    self.speculator.forget(cached.req_id)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _launch_ahead(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sampling's hook, with this step's tokens still on the device: replay the next decode step's graph for the
        planned rows, fed those tokens, and return a host copy of them queued before it, so reading them waits for
        this step's work alone (tolist() on the device tensor would wait for the whole stream)."""
        host_tokens = tokens.to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if tokens.is_cuda else None  # on CPU, host_tokens is tokens
        if copied is not None:
            copied.record()
        rows, size = self.ahead_plan
        if len(tokens) == len(rows.req_ids):  # else a request's sampling failed: its row is gone
            batch = DecodeBatch.padded(np.zeros(len(tokens), dtype=np.int64), rows.positions, rows.slot_mapping,
                                       rows.seq_lens, rows.block_tables, size)
            input_ids, _, _ = self.decode_graphs.load(batch, self.staging)
            input_ids[:len(tokens)].copy_(tokens)
            self.ahead = AheadForward(rows, self.decode_graphs.replay(size))
        if copied is not None:
            copied.synchronize()
        return host_tokens

    def _prepare_inputs(self, so: SchedulerOutput, ahead: AheadForward | None = None) -> ModelInputs:
        if self.staging is not None:
            self.staging.begin_step()
        counts, spec = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
        # Decodes first, longest context first (the torch decode path batches rows of similar length).
        req_ids = sorted(counts, key=lambda r: (counts[r] != 1, -self.requests[r].num_computed_tokens))
        states = [self.requests[r] for r in req_ids]
        drafts = [spec.get(r, []) for r in req_ids]
        num_tokens = np.array([counts[r] for r in req_ids], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start_loc = np.concatenate(([0], np.cumsum(num_tokens)))
        seq_lens = starts + num_tokens
        row_of_token = np.repeat(np.arange(len(req_ids)), num_tokens)
        positions = np.repeat(starts - query_start_loc[:-1], num_tokens) + np.arange(query_start_loc[-1])
        input_ids = np.concatenate([s.token_ids[a:b] + d[:max(0, b - len(s.token_ids))]
                                    for s, d, a, b in zip(states, drafts, starts, seq_lens)])
        table, num_blocks = self._block_table(states)
        slot_mapping = table[row_of_token, positions // self.block_size] * self.block_size \
            + positions % self.block_size
        sampled = [i for i, s in enumerate(states)
                   if seq_lens[i] == len(s.token_ids) + len(drafts[i]) and s.pooling_params is None]
        pooling_jobs = [PoolingJob(s, int(query_start_loc[i]), int(num_tokens[i]), int(starts[i]),
                                   bool(seq_lens[i] == len(s.token_ids)))
                        for i, s in enumerate(states) if s.pooling_params is not None]
        num_decodes = int((num_tokens == 1).sum())
        lora_slots = self._lora_slots(states, num_tokens)
        jobs = [job for i, state in enumerate(states)
                if (job := _prompt_logprob_job(state, int(starts[i]), int(seq_lens[i]), int(query_start_loc[i]),
                                               lora_slots[i]))]
        adapted = any(slot >= 0 for slot in lora_slots)  # captured graphs hold no adapter deltas
        graph_size = self._graph_size(len(req_ids)) if num_decodes == len(req_ids) and not jobs and not adapted \
            else None
        hidden = None
        if graph_size is not None:
            rows = DecodeRows(req_ids, positions, slot_mapping, seq_lens, table, num_blocks)
            picked = None if ahead is None else ahead.rows_for(rows, input_ids, self.block_size)
            if picked is None:
                batch = DecodeBatch.padded(input_ids, positions, slot_mapping, seq_lens, table, graph_size)
                input_ids_t, positions_t, metadata = self.decode_graphs.load(batch, self.staging)
            else:
                self.ahead_hits += 1
                hidden = ahead.hidden[self._tensor(picked)]
                input_ids_t, positions_t = self.decode_graphs.input_ids, self.decode_graphs.positions
                metadata = self.decode_graphs.metadata(graph_size)
            if so.decode_ahead and self.decodes_ahead and len(sampled) == len(states) and not pooling_jobs:
                planned = next_rows(rows, self.block_size, self.config.max_model_len)
                self.ahead_plan = None if planned is None else (planned, graph_size)
        else:
            input_ids_t, positions_t = self._tensor(input_ids), self._tensor(positions)
            metadata = self._attention_metadata(slot_mapping, table, query_start_loc, seq_lens, num_decodes)
        return ModelInputs(input_ids_t, positions_t, metadata,
                           self._tensor(_sampled_rows(query_start_loc[1:][sampled], [drafts[i] for i in sampled])),
                           [self._sample_group(states[i], drafts[i]) for i in sampled], jobs,
                           [lora_slots[i] for i in sampled for _ in range(1 + len(drafts[i]))], pooling_jobs, hidden)

    def _lora_slots(self, states: list[CachedRequestState], num_tokens: np.ndarray) -> list[int]:
        """Each request's adapter slot (-1: none), its adapter put in a slot; every token of the step tagged."""
        if self.lora is None:
            return [-1] * len(states)
        slots = self.lora.slots_for([s.lora_request for s in states])
        self.lora.set_token_slots(np.repeat(slots, num_tokens).tolist())
        return slots

    def _sample_group(self, state: CachedRequestState, drafts: list[int], earlier: list[int] | None = None
                      ) -> SampleGroup:
        probs = self.speculator.draft_probs(state.req_id) if drafts and self.speculator is not None else None
        return SampleGroup(state, drafts, probs, earlier or [])

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

    def _block_table(self, states: list[CachedRequestState]) -> tuple[np.ndarray, np.ndarray]:
        """The step's block table (zero past each request's blocks) and how many blocks each request holds."""
        num_blocks = np.array([len(s.block_ids) for s in states], dtype=np.int64)
        table = np.zeros((len(states), num_blocks.max()), dtype=np.int64)
        for row, state in enumerate(states):
            table[row, :len(state.block_ids)] = state.block_ids
        return table, num_blocks

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """An int64 index array on this rank's device: shared with numpy on CPU, staged through pinned memory on
        CUDA."""
        array = np.ascontiguousarray(array, dtype=np.int64)
        return torch.from_numpy(array) if self.staging is None else self.staging.to_device(array)


def _sampled_rows(ends: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """The token rows to sample: each request's last one, or, verifying k drafts, its last k + 1."""
    if not any(drafts):
        return ends - 1
    num_rows = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    first_of_group = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return np.repeat(ends - num_rows, num_rows) + np.arange(num_rows.sum()) - first_of_group


def _rows_of(groups: list[SampleGroup], failed: dict[str, str]) -> list[int]:
    """The logits rows of the groups whose request did not fail."""
    starts = itertools.accumulate((group.num_rows for group in groups), initial=0)
    return [row for group, start in zip(groups, starts) if group.state.req_id not in failed
            for row in range(start, start + group.num_rows)]


def _prompt_logprobs(logits: torch.Tensor, job: PromptLogprobJob) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)
    next_token_ids = torch.tensor(job.next_token_ids, device=logits.device)
    return PromptLogprobs(*gather_logprobs(logprobs, next_token_ids, job.num_top))


def _prompt_logprob_job(state: CachedRequestState, start: int, end: int, first_row: int, lora_slot: int
                        ) -> PromptLogprobJob | None:
    """Positions start..end-1 of this step; each one before the prompt's last predicts a prompt token. Once a
    token was sampled they were all reported (a preempted request recomputes its prompt without them)."""
    num_top = state.sampling_params.prompt_logprobs
    last = min(end, state.num_prompt_tokens - 1)
    if num_top is None or state.num_output_tokens or last <= start:
        return None
    return PromptLogprobJob(state.req_id, np.arange(first_row, first_row + last - start),
                            state.token_ids[start + 1:last + 1], num_top, lora_slot)


def _staging_bytes(config: EngineConfig) -> int:
    """Pinned bytes for the most one step stages, each array aligned: four int64 arrays indexed by token (ids,
    positions, slots, prompt-logprob rows; a padded decode batch may exceed the token budget, never max_num_seqs),
    the block table, the logits indices, and the int32 query starts and lengths; and a decode batch launched ahead
    (ids, positions, slots, block table, int32 lengths)."""
    rows, seqs = max(config.max_num_batched_tokens, config.max_num_seqs), config.max_num_seqs
    table = seqs * -(-config.max_model_len // config.block_size)
    return 8 * (4 * rows + table + seqs) + 4 * (2 * seqs + 1) + 16 * (seqs + 8) + 8 * (3 * seqs + table) + 4 * seqs + 16 * 5
