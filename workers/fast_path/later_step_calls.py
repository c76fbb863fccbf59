"""A multi-step call's steps after its first (core/multi_step.py decides how many): in one C++ call of the model's
greedy_decode where it takes the requests, else one forward pass and sampler step at a time; both give the tokens
of one call per step. Over several ranks (tensor and pipeline parallel) every rank runs the steps in lockstep: each
in the same C++ call (the TP group's sums and gathers and the stages' hand-offs inside it), else each stage hands its
hidden states to the next as in any step, and the driver's tokens reach every rank after each."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ipc import ModelRunnerOutput, SchedulerOutput
from kernels.cpu_greedy_decode import DraftModelDrafts, PromptLookupDrafts, draw_columns
from kernels.cpu_mtp import MtpDrafts
from kernels.cpu_row_options import SampledRows
from workers.distributed import pipeline_kernel_group, pp_send, ranks_all_reduce, tp_all_reduce
from workers.fast_path.later_steps import LaterSteps, StepBatch, accepted_run
from workers.model_inputs import ModelInputs
from workers.request_state import CachedRequestState
from workers.fast_path.step_grammars import CallGrammars, LentGrammars
from workers.step_sampling import penalized_rows

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner


class LaterStepCalls:
    """The later steps of a ModelRunner's multi-step calls, with its model, sampler, speculator and inputs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def start(self, output: ModelRunnerOutput, states: list[CachedRequestState], scheduled: SchedulerOutput,
              grammars: LentGrammars | None = None) -> None:
        """The driver's later steps of a call whose first step sampled `output` for `states` (none after a failed
        sampling: then only the drafts to verify next), the first step's tokens shared with the other ranks.
        grammars: the constrained requests' matchers (lent by the engine core in this process), whose masks (as
        wide as the first step's) each later step of theirs follows."""
        num_steps = scheduled.num_steps
        goes = num_steps > 1 and not output.failed
        self._share_start(goes, num_steps)
        if goes:
            if self._shares:  # how many tokens each took (drafts accepted, and one more), then the tokens
                taken = [output.sampled_token_ids[state.req_id] for state in states]
                self._shared([len(tokens) for tokens in taken], len(states))
                self._shared([token for tokens in taken for token in tokens], sum(map(len, taken)))
            self.run(output, states, num_steps, CallGrammars(grammars or {}, [state.req_id for state in states],
                                                             [output.sampled_token_ids[s.req_id] for s in states],
                                                             scheduled.grammar_bitmask.words_per_row
                                                             if grammars else 0))
        else:
            output.draft_token_ids = self.runner.propose(output)

    def decline(self, num_steps: int) -> None:
        """The driver takes no later steps this call (it sampled nothing): the other ranks are told."""
        self._share_start(False, num_steps)

    def follow(self, inputs: ModelInputs, num_steps: int) -> None:
        """Another rank's part in the driver's later steps (start()) of a call whose first step took `inputs`: the
        same forward passes (and logits on the last stage), with the driver's tokens for the requests it samples
        (when none fails)."""
        if num_steps > 1 and self._shared(None, 1)[0]:
            states = [group.state for group in inputs.sample_groups]
            counts = self._shared(None, len(states))
            tokens, ends = self._shared(None, sum(counts)), np.cumsum(counts).tolist()
            first = {state.req_id: tokens[end - count:end] for state, count, end in zip(states, counts, ends)}
            self.run(ModelRunnerOutput(sampled_token_ids=first), states, num_steps, CallGrammars({}, [], [], 0))

    @property
    def _shares(self) -> bool:
        """Whether other ranks follow the driver's steps."""
        parallel = self.runner.parallel
        return parallel.tp_size * parallel.pp_size > 1

    def _share_start(self, goes: bool, num_steps: int) -> None:
        if self._shares and num_steps > 1:
            self._shared([int(goes)], 1)

    def _shared(self, tokens: list[int] | None, count: int) -> list[int]:
        """The driver's tokens (None on the other ranks: `count` of them) on every rank: its values summed with the
        others' zeros."""
        values = torch.zeros(count, dtype=torch.int64) if tokens is None else torch.tensor(tokens, dtype=torch.int64)
        return ranks_all_reduce(values).tolist()

    def run(self, output: ModelRunnerOutput, states: list[CachedRequestState], num_steps: int,
            grammars: CallGrammars) -> None:
        """A multi-step call's steps after the first, into the slots the scheduler allocated ahead: each feeds every
        request its last token and the drafts proposed after it (speculative decoding); the accepted drafts and one
        more token (the argmax, or sampled as in any step, over the call's tokens so far) are appended to `output`,
        with the verification; a constrained request's tokens under the mask of its grammar's fork. Ends early once
        no request can go on (workers.fast_path.later_steps). The drafts proposed after the last step go with the
        output. Over several ranks (no drafts then) every rank runs it: all in the same C++ call where it takes the
        requests, else a stage before the last hands its hidden states on, and the driver's tokens of each step are
        shared with the others."""
        runner = self.runner
        tensors = runner.tensors
        driver, shares, last_stage = runner.parallel.is_driver, self._shares, runner.parallel.is_last_stage
        steps = LaterSteps(states, [output.sampled_token_ids[s.req_id] for s in states], *tensors.block_table(states),
                           runner.block_size, runner.config.max_model_len)
        draft_ahead = runner.draft_model.num_drafts if runner.draft_model is not None else 0
        for i in grammars.ended:
            steps.stop(i)
        argmax_only = not grammars and all(state.sampling_params.logits_as_they_are and state.sampling_params.is_greedy
                                           and state.sampling_params.logprobs is None for state in states)
        in_one_call = self._in_one_call(steps, num_steps - 1, output, grammars)
        for _ in range(1, 1 if in_one_call else num_steps):
            rows = steps.active()
            if not rows:
                break
            # Over several ranks the Python steps feed no drafts (the driver alone proposes them).
            proposed = {} if shares else runner.propose(output, [states[i] for i in steps.with_room(rows, draft_ahead)])
            batch = steps.batch(rows, {i: proposed[states[i].req_id] for i in rows if states[i].req_id in proposed})
            metadata = tensors.attention_metadata(batch.slot_mapping, batch.block_table, batch.query_start_loc,
                                                  batch.seq_lens, batch.num_decodes)
            feeds = np.array([len(feed) for feed in batch.feeds])
            slots = runner.lora_slots([states[i] for i in batch.rows], feeds)  # each token's adapter, if any
            hidden = runner.forward(ModelInputs(tensors.indices(batch.input_ids), tensors.indices(batch.positions),
                                                metadata, tensors.indices(np.arange(len(batch.input_ids))), [], []))
            if last_stage:
                logits = runner.logits(hidden, np.repeat(slots, feeds).tolist())  # on the driver only
            else:
                pp_send(hidden)
            if not driver:
                runs = [[token] if token >= 0 else None for token in self._shared(None, len(batch.rows))]
            elif argmax_only:  # as the sampler takes a plain greedy row
                argmax = logits.argmax(dim=-1).tolist()
                runs = [accepted_run(feed[1:], argmax[first:first + len(feed)])
                        for feed, first in zip(batch.feeds, batch.query_start_loc)]
            else:
                runs = self._sample_later_step(logits, steps, batch, output, grammars)
            if driver and shares:  # one token each (no drafts over several ranks), -1: its sampling failed
                self._shared([-1 if run is None else run[0] for run in runs], len(runs))
            for i, feed, run in zip(batch.rows, batch.feeds, runs):
                if run is None:
                    steps.stop(i)
                    continue
                steps.take(i, run)
                grammars.take(i, run)
                if i in grammars.ended:
                    steps.stop(i)
                if len(feed) > 1:
                    output.verified.setdefault(states[i].req_id, []).append((len(feed) - 1, len(run) - 1))
            if runner._observes:
                self._observe(hidden, states, batch, output)
        output.draft_token_ids = runner.propose(output, [states[i] for i in steps.with_room(range(len(states)),
                                                                                          draft_ahead)])

    def _sample_later_step(self, logits: torch.Tensor, steps: LaterSteps, batch: StepBatch,
                           output: ModelRunnerOutput, grammars: CallGrammars) -> list[list[int] | None]:
        """Each row's tokens from the sampler (its accepted drafts and the token after them; None where its sampling
        failed, recorded in `output`): masked by its grammar, sampled, penalized and banned over its tokens and the
        call's so far; the logprobs of those that ask, after those of the call's earlier tokens in `output`."""
        groups = [self.runner.sample_group(steps.states[i], feed[1:], steps.tokens[i])
                  for i, feed in zip(batch.rows, batch.feeds)]
        bitmask = grammars.bitmask(batch.rows, [group.state.req_id for group in groups]) if grammars else None
        sampled = self.runner.step_sampler.sample(logits, groups, bitmask)
        output.failed.update(sampled.failed)
        for req_id, token_ids in sampled.logprob_token_ids.items():
            _add_logprobs(output, req_id, token_ids, sampled.logprobs[req_id], sampled.sampled_ranks[req_id])
        return [sampled.sampled_token_ids.get(group.state.req_id) for group in groups]

    def _in_one_call(self, steps: LaterSteps, count: int, output: ModelRunnerOutput, grammars: CallGrammars) -> bool:
        """Up to `count` steps of the active requests in one call of the model's greedy_decode (where it has one
        that takes them), drawing sampled requests' tokens as the sampler would (from logits masked by their
        grammar's fork, biased, penalized and banned as it processes them), reporting the logprobs it would, and
        verifying the drafts the speculator would propose as the sampler verifies them, which the kernel writes
        itself (prompt lookup's, or a draft model's or the MTP layer's processed and drawn as the target's), the
        tokens taken into `steps`, failures, logprobs and verifications into `output`; whether it ran."""
        runner = self.runner
        greedy = getattr(runner.model, "greedy_decode", None)
        rows = steps.active()
        if greedy is None or not rows:
            return False
        parallel = runner.parallel
        states, speculator = [steps.states[i] for i in rows], runner.speculator
        drafting = speculator is not None and speculator.speculates(len(output.sampled_token_ids))
        drafts = None
        if drafting or runner._observes:  # a proposer that reads hidden states (MTP) takes every step's all the same
            drafts = speculator.kernel_drafts(states, [state.token_ids + steps.tokens[i] for state, i in
                                                       zip(states, rows)], steps.capacity[rows], drafting)
        ready = drafts is not None or not (drafting or runner._observes)
        # Over pipeline stages, or with drafts over several ranks, the driver alone drafts and chooses and the others
        # follow it in the call (kernels/csrc/driver_steps.h): every rank must make it, the driver's drafts' k known.
        follows = self._shares and (parallel.pp_size > 1 or runner.config.speculative_config is not None)
        if follows:
            ready, k = self._ranks_ready(len(rows), ready and not runner._observes,
                                         drafts.k if drafting and drafts is not None else 0)
            if ready and k and drafts is None:  # the driver's drafts reach this rank in the call
                drafts = PromptLookupDrafts(k, 1, 1, [[] for _ in rows])
        if not ready:
            return False
        chooses = not follows or parallel.is_driver
        sampled = chooses and not all(state.sampling_params.is_greedy for state in states)
        processed = chooses and not all(state.sampling_params.logits_as_they_are for state in states)
        limits = steps.limits(rows)
        drawn_drafts = isinstance(drafts, (DraftModelDrafts, MtpDrafts))
        sampled_rows, seeded = self._sampled_rows(states, limits, draw_columns(
            limits, count, drafts.k if drafts else 0, drawn_drafts), follows) if sampled else (None, [])
        reports = [state.sampling_params.logprobs if chooses else None for state in states]
        run = greedy(np.array([steps.tokens[i][-1] for i in rows], dtype=np.int64), steps.context[rows] - 1,
                     steps.table[rows], limits, [steps.stops[i] for i in rows], count, drafts, sampled_rows,
                     penalized_rows(states, [steps.tokens[i] for i in rows]) if processed else None,
                     np.array([-1 if n is None else n for n in reports]) if any(n is not None for n in reports)
                     else None, self._adapter_slots(states), grammars.masks(rows) if grammars else None)
        self._rewind(states, seeded, np.zeros(len(states), dtype=np.int64) if run is None else run.drawn)
        if run is None:
            return False
        for index, (i, row, failed) in enumerate(zip(rows, run.tokens, run.failed)):
            taken = row[row >= 0].tolist()
            steps.take(i, taken)
            if reports[index] is not None:
                _add_logprobs(output, steps.states[i].req_id, *run.logprobs.of_row(index, len(taken)))
            if failed:
                output.failed[steps.states[i].req_id] = "no token to sample: every logit is -inf, or one is NaN"
                steps.stop(i)
        if drafts is not None and speculator is not None:
            speculator.resume(states, drafts, steps.context[rows])
        if run.verified is not None:
            for i, checks in zip(rows, run.verified):
                checks = checks[checks[:, 0] >= 0]
                if len(checks):
                    output.verified.setdefault(steps.states[i].req_id, []).extend(map(tuple, checks.tolist()))
        return True

    def _ranks_ready(self, rows: int, ready: bool, k: int) -> tuple[bool, int]:
        """Whether every rank is ready (this one says `ready`) to take `rows` rows in its greedy_decode, and the
        driver's drafts' k (0: none; `k` on the driver): a sum over every rank. Pipeline stages whose ranks do not
        all share this host's memory take the Python steps (every rank knows, with no exchange)."""
        if self.runner.parallel.pp_size > 1 and pipeline_kernel_group() is None:
            return False, 0
        model = self.runner.model.greedy_model()
        ready = ready and model is not None and rows <= model.max_rows
        not_ready, k = ranks_all_reduce(torch.tensor([0 if ready else 1, k], dtype=torch.int64)).tolist()
        return not_ready == 0, k

    def _observe(self, hidden: torch.Tensor, states: list[CachedRequestState], batch: StepBatch,
                 output: ModelRunnerOutput) -> None:
        """A later step's hidden states to the proposer, each row's with the token now known after it."""
        rows = [(states[i].req_id, int(first), int(batch.positions[first]), len(feed))
                for i, feed, first in zip(batch.rows, batch.feeds, batch.query_start_loc)]
        self.runner.speculator.observe(hidden, rows, self.runner.requests, output.sampled_token_ids)

    def _adapter_slots(self, states: list[CachedRequestState]) -> np.ndarray | None:
        """Each request's adapter slot (-1: none), None when none has an adapter."""
        if self.runner.lora is None or all(state.lora_request is None for state in states):
            return None
        return np.array(self.runner.lora_slots(states, np.ones(len(states), dtype=np.int64)), dtype=np.int64)

    def _sampled_rows(self, states: list[CachedRequestState], limits: np.ndarray, columns: int, follows: bool
                      ) -> tuple[SampledRows, list[tuple[int, torch.Tensor]]]:
        """The requests' sampling options and `columns` uniform draws each: a seeded request's from its own
        generator, in the order the sampler's steps would draw them (the kernel reads them so), the others' from the
        shared one (float32, as the sampler's); and each seeded row's generator state before its draws (for
        _rewind). The driver draws them; where the other ranks choose too (one stage's, without drafts: not
        `follows`) they get its draws (a sum with their zeros), so every rank's call takes the same tokens."""
        params = [state.sampling_params for state in states]
        draws = torch.zeros(len(states), columns, dtype=torch.float64)
        seeded = []
        if self.runner.parallel.is_driver:
            draws.copy_(torch.empty(draws.shape).uniform_(generator=self.runner.sampler.generator))
            for row, state in enumerate(states):
                if state.generator is not None and not state.sampling_params.is_greedy:
                    seeded.append((row, state.generator.get_state()))
                    draws[row] = torch.empty(draws.shape[1]).uniform_(generator=state.generator)
        if self._shares and not follows:
            tp_all_reduce(draws)
        return SampledRows(np.array([0.0 if p.is_greedy else p.temperature for p in params], dtype=np.float32),
                           np.array([p.top_k for p in params], dtype=np.int64),
                           np.array([p.top_p for p in params], dtype=np.float32),
                           np.array([p.min_p for p in params], dtype=np.float32), draws.numpy()), seeded

    @staticmethod
    def _rewind(states: list[CachedRequestState], seeded: list[tuple[int, torch.Tensor]], drawn: np.ndarray) -> None:
        """Each seeded row's generator as if it had drawn only what the call read (as the sampler's steps would)."""
        for row, state in seeded:
            generator = states[row].generator
            generator.set_state(state)
            torch.empty(int(drawn[row])).uniform_(generator=generator)


def _add_logprobs(output: ModelRunnerOutput, req_id: str, ids: list[list[int]], values: list[list[float]],
                  ranks: list[int]) -> None:
    """A request's logprobs of more tokens, after those of its earlier tokens in `output`."""
    output.logprob_token_ids.setdefault(req_id, []).extend(ids)
    output.logprobs.setdefault(req_id, []).extend(values)
    output.sampled_ranks.setdefault(req_id, []).extend(ranks)
