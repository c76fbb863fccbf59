"""LaterSteps: the requests of a multi-step call after its first step (core/multi_step.py), what bounds each one's
next tokens, and each step's flat batch: every request's last token, then any drafts it verifies."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.sampling_params import tokens_left
from workers.request_state import CachedRequestState


@dataclass
class StepBatch:
    """One step's tokens, requests with a single token first (as attention wants them)."""

    rows: list[int]  # the requests, as indices into LaterSteps.states, in batch order
    feeds: list[list[int]]  # each one's tokens: its last token, then its drafts
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_table: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_decodes: int


class LaterSteps:
    """`tokens[i]`: what the call gave states[i] so far (the first step's tokens), extended in place. A request sits
    out the steps after a stop token (what follows one is dropped anyway), max_tokens or a failed sampling, or once
    its blocks (and max_model_len) have no slot for its next token; the K/V of all its tokens but the last are
    computed."""

    def __init__(self, states: list[CachedRequestState], tokens: list[list[int]], table: np.ndarray,
                 num_blocks: np.ndarray, block_size: int, max_model_len: int) -> None:
        """table, num_blocks: the requests' block table and how many blocks each holds."""
        self.states, self.tokens, self.table, self.block_size = states, tokens, table, block_size
        self.capacity, self.max_model_len = np.minimum(num_blocks * block_size, max_model_len), max_model_len
        self.context = np.array([len(s.token_ids) + len(t) for s, t in zip(states, tokens)], dtype=np.int64)
        self.stops = [s.stop_token_ids() for s in states]  # min_tokens is reached before a multi-step call
        self.stopped = [not stops.isdisjoint(t) for stops, t in zip(self.stops, tokens)]

    def free_slots(self, i: int) -> int:
        """Positions from its last token on (not computed yet) that its blocks leave it."""
        return int(self.capacity[i] - self.context[i] + 1)

    def left(self, i: int) -> int:
        """Tokens it may still take: up to max_tokens and max_model_len."""
        state = self.states[i]
        return tokens_left(state.sampling_params.max_tokens, state.num_output_tokens + len(self.tokens[i]),
                           self.max_model_len, int(self.context[i]))

    def active(self) -> list[int]:
        return [i for i in range(len(self.states))
                if not self.stopped[i] and self.left(i) > 0 and self.free_slots(i) > 0]

    def limits(self, rows: list[int]) -> np.ndarray:
        """How many more tokens each of `rows` may take: up to max_tokens, max_model_len and its last free slot (a
        stop token may end it sooner)."""
        return np.array([min(self.left(i), self.free_slots(i)) for i in rows], dtype=np.int64)

    def with_room(self, rows: list[int], ahead: int) -> list[int]:
        """Those with `ahead` free slots at least (a draft model writes its drafts' K/V ahead while drafting)."""
        return [i for i in rows if self.free_slots(i) >= ahead]

    def batch(self, rows: list[int], drafts: dict[int, list[int]]) -> StepBatch:
        """Each request's last token and its drafts, cut to its free slots, max_tokens and max_model_len."""
        feeds = [[self.tokens[i][-1]] + drafts.get(i, [])[:min(self.free_slots(i), self.left(i)) - 1] for i in rows]
        if all(len(feed) == 1 for feed in feeds):  # plain decode steps: the same in fewer array operations
            every = len(rows) == len(self.states)
            seq_lens = self.context.copy() if every else self.context[rows]
            positions, table = seq_lens - 1, self.table if every else self.table[rows]
            slots = table[np.arange(len(rows)), positions // self.block_size] * self.block_size \
                + positions % self.block_size
            return StepBatch(rows, feeds, np.array([feed[0] for feed in feeds], dtype=np.int64), positions, slots,
                             table, np.arange(len(rows) + 1), seq_lens, len(rows))
        order = sorted(range(len(rows)), key=lambda j: len(feeds[j]) != 1)
        rows, feeds = [rows[j] for j in order], [feeds[j] for j in order]
        lengths = np.fromiter(map(len, feeds), dtype=np.int64, count=len(feeds))
        starts = self.context[rows] - 1
        query_start_loc = np.concatenate(([0], np.cumsum(lengths)))
        num_tokens = int(query_start_loc[-1])
        positions = np.repeat(starts - query_start_loc[:-1], lengths) + np.arange(num_tokens)
        table = self.table[rows]
        token_rows = np.repeat(np.arange(len(rows)), lengths)
        slots = table[token_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        input_ids = np.fromiter((t for feed in feeds for t in feed), dtype=np.int64, count=num_tokens)
        return StepBatch(rows, feeds, input_ids, positions, slots, table, query_start_loc, starts + lengths,
                         int((lengths == 1).sum()))

    def take(self, i: int, tokens: list[int]) -> None:
        """Append the tokens a step gave it (a stop token among them ends its steps)."""
        self.tokens[i].extend(tokens)
        self.context[i] += len(tokens)
        self.stopped[i] = self.stopped[i] or not self.stops[i].isdisjoint(tokens)

    def stop(self, i: int) -> None:
        """It takes no more steps in this call (its sampling failed)."""
        self.stopped[i] = True


def accepted_run(drafted: list[int], argmax: list[int]) -> list[int]:
    """The drafts up to the first the model's argmax (one per fed token) disagrees with, and the argmax there."""
    accepted = next((j for j, (d, t) in enumerate(zip(drafted, argmax)) if d != t), len(drafted))
    return argmax[:accepted + 1]
