"""DraftModel: a smaller model with the target's vocabulary writes each request's drafts one token at a time, with
KV tensors of its own addressed by the target's block table (the scheduler allocates the slots it writes ahead)."""
from __future__ import annotations

import numpy as np
import torch

from ipc import SpeculativeConfig
from kernels.cpu_greedy_decode import DraftModelDrafts
from workers.distributed import single_rank
from workers.layers.sampler import Sampler
from workers.model_config import load_hf_config
from workers.model_loader import load_model
from workers.request_state import CachedRequestState
from workers.spec_decode.feeds import FeedBatch, ProposerCaches, append_drafts


class DraftModel(ProposerCaches):
    """Held whole by the driver rank alone: under tensor or pipeline parallelism the other ranks never wait for it,
    and a model 5-10x smaller gains little from being split."""

    reads_hidden_states = False

    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                 max_model_len: int, sampler: Sampler) -> None:
        self.num_drafts, self.block_size, self.max_model_len = config.num_speculative_tokens, block_size, max_model_len
        # The target's dtype: on the CPU a multi-step call's later steps run both models in one kernel of one dtype.
        self.dtype, self.device, self.sampler = dtype, device, sampler
        with single_rank():
            self.model = load_model(config.model, load_hf_config(config.model), self.dtype, device)
        # Per request: the position its draft KV is known right up to, and the drafts written after it (right while
        # the target accepts them); the distributions its last drafts were drawn from (sampled requests).
        self.fed: dict[str, tuple[int, list[int]]] = {}
        self.probs: dict[str, torch.Tensor] = {}
        # Greedy drafts the target's kernel already wrote after a request's first this-many tokens (resume()).
        self.written: dict[str, tuple[int, list[int]]] = {}

    def forget(self, req_id: str) -> None:
        """Its blocks were freed or replaced (finished, preempted): its draft KV is gone."""
        self.fed.pop(req_id, None)
        self.probs.pop(req_id, None)
        self.written.pop(req_id, None)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.probs.get(req_id)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], new_tokens: list[list[int]]) -> list[list[int]]:
        """Drafts after each request's tokens (its state's plus the ones just sampled): first catch the draft's KV up
        (its prompt on the first call, else the last accepted tokens), then one token at a time."""
        contexts = [state.token_ids + tokens for state, tokens in zip(states, new_tokens)]
        counts = [min(self.num_drafts, self.max_model_len - len(context)) for context in contexts]
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        for i, (state, context) in enumerate(zip(states, contexts)):
            written = self.written.pop(state.req_id, None)
            if written is not None and written[0] == len(context):
                drafts[i], counts[i] = written[1][:counts[i]], 0  # the kernel drafted after these tokens already
                if (drawn_from := self.probs.get(state.req_id)) is not None:  # a sampled request's (resume())
                    probs[i] = list(drawn_from[:len(drafts[i])])
        starts = [self._known(state.req_id, context) for state, context in zip(states, contexts)]
        active = [i for i, count in enumerate(counts) if count > 0]
        feeds = {i: (starts[i], contexts[i][starts[i]:]) for i in active}
        with single_rank():
            for step in range(max(counts, default=0)):
                active = [i for i in active if step < counts[i]]
                logits = self._forward([states[i] for i in active], [feeds[i] for i in active])
                drawn = append_drafts(self.sampler, logits, states, new_tokens, active, drafts, probs)
                for i, token in zip(active, drawn):
                    feeds[i] = (len(contexts[i]) + step, [token])
        for i, state in enumerate(states):
            self._record(state.req_id, len(contexts[i]), drafts[i], probs[i])
        return drafts

    def kernel_drafts(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray
                      ) -> DraftModelDrafts | None:
        """Its drafts (all the requests' tokens so far in `contexts`; the positions their blocks give in `capacity`)
        as the target's greedy_decode() writes them in C++, where its model runs there (layers prepared by a one-call
        step for its bound caches); resume() takes what its K/V holds after, and the distributions a sampled
        request's next drafts were drawn from."""
        greedy_model = getattr(self.model, "greedy_model", None)
        with single_rank():  # the whole draft, not this rank's stage or shard
            model = greedy_model() if greedy_model is not None else None
        if model is None:
            return None
        known = np.array([self._known(state.req_id, context) for state, context in zip(states, contexts)],
                         dtype=np.int64)
        sampled = not all(state.sampling_params.is_greedy for state in states)
        return DraftModelDrafts(self.num_drafts, model, contexts, known, np.ascontiguousarray(capacity, dtype=np.int64),
                                np.full((len(states), self.num_drafts), -1, dtype=np.int64),
                                np.zeros((len(states), self.num_drafts, model.vocab_size), dtype=np.float32)
                                if sampled else None)

    def resume(self, states: list[CachedRequestState], drafts: DraftModelDrafts, lengths: np.ndarray) -> None:
        """After greedy_decode() drafted for `states`, now `lengths` tokens long: its K/V holds each one's tokens
        below drafts.known and its last token, then the drafts it wrote after the last step but their last (propose()
        hands those out without running again, with the distributions a sampled request's were drawn from)."""
        for row, (state, fed, length, after) in enumerate(zip(states, drafts.known.tolist(), lengths.tolist(),
                                                              drafts.next.tolist())):
            self.probs.pop(state.req_id, None)
            if after[0] >= 0:
                self.fed[state.req_id], self.written[state.req_id] = (length, after[:-1]), (length, after)
                if not state.sampling_params.is_greedy:
                    self.probs[state.req_id] = torch.from_numpy(drafts.next_q[row].copy())
            else:
                self.fed[state.req_id] = (min(fed, length - 1), [])

    def _known(self, req_id: str, context: list[int]) -> int:
        """Up to which position the draft's KV holds this context: what it knew, and its drafts the target kept."""
        known, fed = self.fed.get(req_id, (0, []))
        for token, actual in zip(fed, context[known:]):
            if token != actual:
                break
            known += 1
        return min(known, len(context) - 1)  # the last token is fed again: its logits give the first draft

    def _record(self, req_id: str, num_tokens: int, drafts: list[int], probs: list[torch.Tensor]) -> None:
        self.fed[req_id] = (num_tokens, drafts[:-1])  # the last draft was never fed
        if probs:
            self.probs[req_id] = torch.stack(probs)
        else:
            self.probs.pop(req_id, None)

    def _forward(self, states: list[CachedRequestState], feeds: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The draft's logits after each feed (tokens from a start position)."""
        batch = FeedBatch.of(states, feeds, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.metadata)
        return self.model.compute_logits(hidden[batch.last_rows]).float()
