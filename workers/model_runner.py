"""ModelRunner: keeps per-request state, flattens one mixed prefill/decode batch, runs this rank's share of the
model (receiving from / sending to neighbouring pipeline stages), and samples on the driver rank. On CUDA the
step's index arrays go through pinned staging and decode-only batches replay CUDA graphs."""
from __future__ import annotations

import logging

import numpy as np
import torch
from transformers import PretrainedConfig

from ipc import EngineConfig, ModelRunnerOutput, PoolingInfo, SchedulerOutput
from kernels.gemv_choice import GemvChoice
from workers.cuda_graphs import DecodeBatch, DecodeGraphs
from workers.decode_ahead import AheadForward, DecodeRows, launch_ahead, next_rows
from workers.distributed import Intermediate, parallel_state, pp_recv, pp_send
from workers.encoder_cache import ENCODER_CACHE_BYTES, EncoderCache
from workers.fast_path.later_step_calls import LaterStepCalls
from workers.layers.attention import Attention, DecodeMetadata
from workers.layers.fused_moe import FusedMoE
from workers.layers.sampler import Sampler
from workers.lora.manager import LoRAManager
from workers.model_inputs import (ModelInputs, PoolingJob, prompt_logprob_job, prompt_logprobs_of, rows_of,
                                  sampled_rows)
from workers.model_loader import load_model
from workers.pinned_staging import PinnedStaging, staging_bytes
from workers.pooling.pooler import ChunkedPooling, finish_embedding
from workers.profile_step import profile_step
from workers.prompt_embeds import step_embeds
from workers.request_state import CachedRequestState, update_states
from workers.runner_caches import RunnerCaches
from workers.spec_decode import make_speculator
from workers.spec_decode.feeds import ProposerCaches
from workers.fast_path.step_grammars import LentGrammars
from workers.step_tensors import StepTensors
from workers.step_sampling import SampleGroup, StepSampler, fails_alone

logger = logging.getLogger("pagedserve.model_runner")


class ModelRunner(RunnerCaches):
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device, pooling: PoolingInfo) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.block_size = config.block_size
        self.hidden_size: int = hf_config.get_text_config().hidden_size
        self.parallel = parallel_state()
        self.model = load_model(config.model, hf_config, dtype, device, config.quantization, config.quantize_lm_head,
                                config.load_format)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed))
        self.step_sampler = StepSampler(self.sampler, device)
        # Only the driver samples, so only it proposes drafts (and holds a draft model).
        self.speculator = make_speculator(config.speculative_config, config.model, dtype, device, self.block_size,
                                          config.max_model_len, self.sampler) if self.parallel.is_driver else None
        self.requests: dict[str, CachedRequestState] = {}
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        self.kv_caches: list[torch.Tensor] = []
        self.staging = PinnedStaging(staging_bytes(config), device) if device.type == "cuda" else None
        self.tensors = StepTensors(self.block_size, self.staging)
        self.decode_graphs: DecodeGraphs | None = None
        # Decode ahead (workers/decode_ahead.py): the rows the sampling of this step launches the next forward pass
        # for, with the graph size, and the forward pass last launched, until the next step takes or drops it.
        self.ahead_plan: tuple[DecodeRows, int] | None = None
        self.ahead: AheadForward | None = None
        self.ahead_hits = 0  # decode steps whose forward pass ran ahead
        self.gemv_choices: list[GemvChoice] = []  # what start-up timing chose for one-row products (CUDA)
        self.lora = LoRAManager(self.model, config, dtype, device) if config.enable_lora else None
        if self.lora is not None and self._captures_cuda_graphs():
            self.lora.prepare_graphs()  # before the memory profile: the slots count against the KV budget
        self.pooling = pooling
        self.chunked_pooling = ChunkedPooling(pooling.pooling_type)
        self.later_steps = LaterStepCalls(self)
        self.encoder_cache = EncoderCache(self.model.encode_images, device,
                                          config.encoder_cache_memory or ENCODER_CACHE_BYTES) \
            if getattr(self.model, "takes_images", False) and self.parallel.is_first_stage else None

    @property
    def decodes_ahead(self) -> bool:
        """Whether decode steps' forward passes run ahead: CUDA graphs captured, no draft tokens to propose."""
        return self.decode_graphs is not None and self.config.decode_ahead and self.speculator is None

    @property
    def multi_steps(self) -> int:
        """The most decode steps one call runs (core/multi_step.py): on the CPU (CUDA graphs and decode ahead take
        that cost off the GPU's path); over several ranks (tensor and pipeline parallel) every rank runs them
        (workers.fast_path.later_step_calls). With speculative decoding, each step verifies the drafts proposed after
        the one before (a proposer that reads hidden states reads each later step's; over several ranks only in the
        C++ call, whose driver drafts for every rank). Experts split over data-parallel engines: one forward pass
        per call, which every engine matches."""
        if self.device.type != "cpu" or self.decode_graphs is not None or self.parallel.experts is not None:
            return 1
        return self.config.num_scheduler_steps

    @property
    def draft_model(self) -> ProposerCaches | None:
        """The proposer with a model and KV cache of its own (a draft model, an MTP layer), if any."""
        return self.speculator.proposer \
            if self.speculator and isinstance(self.speculator.proposer, ProposerCaches) else None

    @property
    def _observes(self) -> bool:
        """Whether the proposer reads each step's hidden states (MTP)."""
        return self.speculator is not None and self.speculator.reads_hidden_states

    def profile_run(self) -> None:
        """The step with the largest activations, for the memory profile (workers.profile_step)."""
        profile_step(self)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammars: LentGrammars | None = None) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        ahead, self.ahead, self.ahead_plan = self.ahead, None, None  # a step ahead serves the next step only
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self.parallel.experts is not None:  # a wave's dummy batch (core/waves.py)
                for layer in self.moe_layers:
                    layer.dummy_pass()
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output, ahead)
        hidden = self.forward(inputs)
        if not self.parallel.is_last_stage:
            pp_send(hidden)
            self.later_steps.follow(inputs, scheduler_output.num_steps)
            return ModelRunnerOutput(sampled_token_ids={})
        # Every TP rank takes part in computing logits; only the driver gets them, and samples.
        prompt_logits = [self.logits(hidden[self.tensors.indices(job.rows)], [job.lora_slot] * len(job.rows))
                         for job in inputs.prompt_logprob_jobs]
        logits = self.logits(hidden[inputs.logits_indices], inputs.lora_row_slots) if inputs.sample_groups \
            else None
        if not self.parallel.is_driver:
            self.later_steps.follow(inputs, scheduler_output.num_steps)
            return ModelRunnerOutput(sampled_token_ids={})
        failed: dict[str, str] = {}
        pooled = self._pool(hidden, inputs.pooling_jobs, failed)
        prompt_logprobs = {}
        for job, job_logits in zip(inputs.prompt_logprob_jobs, prompt_logits):
            with fails_alone(job.req_id, failed):
                prompt_logprobs[job.req_id] = prompt_logprobs_of(job_logits, job)
        groups = [group for group in inputs.sample_groups if group.state.req_id not in failed]
        if logits is None or not groups:
            if self._observes:
                self.speculator.observe(hidden, inputs.rows, self.requests, {})
            self.later_steps.decline(scheduler_output.num_steps)
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs, failed=failed,
                                     pooled=pooled)
        if len(groups) < len(inputs.sample_groups):
            logits = logits[rows_of(inputs.sample_groups, failed)]
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
        if self._observes:
            self.speculator.observe(hidden, inputs.rows, self.requests, sampled)
        self.later_steps.start(output, [group.state for group in groups], scheduler_output, grammars)
        return output

    def propose(self, output: ModelRunnerOutput, states: list[CachedRequestState] | None = None
                 ) -> dict[str, list[int]]:
        """Drafts to verify next, after the tokens sampled so far (none without speculative decoding); for `states`
        only if given."""
        if self.speculator is None:
            return {}
        return self.speculator.propose(self.requests, output.sampled_token_ids,
                                       None if states is None else [state.req_id for state in states])

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

    def logits(self, hidden: torch.Tensor, lora_slots: list[int] | None) -> torch.Tensor | None:
        if self.lora is not None:
            self.lora.set_row_slots(lora_slots or [])
        return self.model.compute_logits(hidden)

    def forward(self, inputs: ModelInputs) -> torch.Tensor | Intermediate:
        """This stage's layers; a stage after the first starts from the previous stage's hidden states."""
        if inputs.hidden is not None:
            return inputs.hidden
        if isinstance(inputs.metadata, DecodeMetadata):
            return self.decode_graphs.replay(len(inputs.input_ids))
        args = (inputs.input_ids, inputs.positions, inputs.metadata)
        if self.parallel.is_first_stage:
            return self.model(*args) if inputs.prompt_embeds is None else self.model(*args, None, inputs.prompt_embeds)
        return self.model(*args, pp_recv(self.model.num_intermediate_tensors, len(inputs.input_ids), self.hidden_size,
                                         self.dtype, self.device))

    def _update_states(self, so: SchedulerOutput) -> None:
        finished, resumed = update_states(self.requests, so)
        for req_id in finished:
            self.chunked_pooling.forget(req_id)
        if self.speculator is not None:
            for req_id in finished + resumed:
                self.speculator.forget(req_id)

    def _launch_ahead(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sampling's hook: the next decode step's forward pass launched for the planned rows
        (workers.decode_ahead.launch_ahead)."""
        rows, size = self.ahead_plan
        host_tokens, self.ahead = launch_ahead(self.decode_graphs, self.staging, rows, size, tokens)
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
        table, num_blocks = self.tensors.block_table(states)
        slot_mapping = table[row_of_token, positions // self.block_size] * self.block_size \
            + positions % self.block_size
        sampled = [i for i, s in enumerate(states)
                   if seq_lens[i] == len(s.token_ids) + len(drafts[i]) and s.pooling_params is None]
        pooling_jobs = [PoolingJob(s, int(query_start_loc[i]), int(num_tokens[i]), int(starts[i]),
                                   bool(seq_lens[i] == len(s.token_ids)))
                        for i, s in enumerate(states) if s.pooling_params is not None]
        num_decodes = int((num_tokens == 1).sum())
        lora_slots = self.lora_slots(states, num_tokens)
        jobs = [job for i, state in enumerate(states)
                if (job := prompt_logprob_job(state, int(starts[i]), int(seq_lens[i]), int(query_start_loc[i]),
                                               lora_slots[i]))]
        # Graphs hold the adapters' deltas (slots read from a device buffer), not an adapter's own embeddings.
        lora_eager = self.lora is not None and not self.lora.graph_safe(lora_slots)
        embeds = step_embeds(states, starts, seq_lens, query_start_loc, self.dtype, self.device, self.encoder_cache)
        graph_size = self._graph_size(len(req_ids)) \
            if num_decodes == len(req_ids) and not jobs and not lora_eager and embeds is None else None
        hidden = None
        if graph_size is not None:
            rows = DecodeRows(req_ids, positions, slot_mapping, seq_lens, table, num_blocks)
            picked = None if ahead is None else ahead.rows_for(rows, input_ids, self.block_size)
            if picked is None:
                batch = DecodeBatch.padded(input_ids, positions, slot_mapping, seq_lens, table, graph_size)
                input_ids_t, positions_t, metadata = self.decode_graphs.load(batch, self.staging)
            else:
                self.ahead_hits += 1
                hidden = ahead.hidden[self.tensors.indices(picked)]
                input_ids_t, positions_t = self.decode_graphs.input_ids, self.decode_graphs.positions
                metadata = self.decode_graphs.metadata(graph_size)
            if so.decode_ahead and self.decodes_ahead and len(sampled) == len(states) and not pooling_jobs:
                planned = next_rows(rows, self.block_size, self.config.max_model_len)
                self.ahead_plan = None if planned is None else (planned, graph_size)
        else:
            input_ids_t, positions_t = self.tensors.indices(input_ids), self.tensors.indices(positions)
            metadata = self.tensors.attention_metadata(slot_mapping, table, query_start_loc, seq_lens, num_decodes)
        return ModelInputs(input_ids_t, positions_t, metadata,
                           self.tensors.indices(sampled_rows(query_start_loc[1:][sampled],
                                                             [drafts[i] for i in sampled])),
                           [self.sample_group(states[i], drafts[i]) for i in sampled], jobs,
                           [lora_slots[i] for i in sampled for _ in range(1 + len(drafts[i]))], pooling_jobs, hidden,
                           embeds, [(req_id, int(query_start_loc[i]), int(starts[i]), int(num_tokens[i]))
                                    for i, req_id in enumerate(req_ids)] if self._observes else None)

    def lora_slots(self, states: list[CachedRequestState], num_tokens: np.ndarray) -> list[int]:
        """Each request's adapter slot (-1: none), its adapter put in a slot; every token of the step tagged."""
        if self.lora is None:
            return [-1] * len(states)
        slots = self.lora.slots_for([s.lora_request for s in states])
        self.lora.set_token_slots(np.repeat(slots, num_tokens).tolist())
        return slots

    def sample_group(self, state: CachedRequestState, drafts: list[int], earlier: list[int] | None = None
                      ) -> SampleGroup:
        probs = self.speculator.draft_probs(state.req_id) if drafts and self.speculator is not None else None
        return SampleGroup(state, drafts, probs, earlier or [])
