"""A multi-step call's later steps of a whole model in one C++ call (kernels/csrc/greedy_decode.h): per step the
embedding, the prepared layers (kernels.cpu_decoder_layer), the final norm, the LM head, the argmax or a sampled
token, drafts proposed and verified, stops checked; what the Python loop computes step by step, without its per-step
Python and dispatch."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_gemv
from kernels.cpu_decoder_layer import PreparedLayers, ShmGroup
from kernels.cpu_layer_weights import pointer
from kernels.cpu_mtp import MtpDrafts
from kernels.cpu_row_options import GrammarMasks, PenalizedRows, SampledRows, flat_lists


@dataclass(frozen=True)
class PipelinePlace:
    """A pipeline stage's place among the ranks as greedy_decode() takes it: the shared memory of every rank's group
    (rank = stage * tp_size + TP rank), this stage, how many there are and the TP size."""

    world: ShmGroup
    stage: int
    stages: int
    tp_size: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


@dataclass(frozen=True)
class GreedyModel:
    """A model as greedy_decode() takes it: its layers prepared with the final norm, its embedding and LM head of
    the layers' dtype (rows past vocab_size ignored), the head's kernels.cpu_gemv.pair_weight copy where kept, the
    scale each embedding row is multiplied by (rounded to the dtype first; 0: none, Gemma's sqrt(hidden)), the
    logits' tanh soft cap (0: none, Gemma 2's) and a table of learned positions added to each row (OPT's). max_rows:
    the most token rows of a step its kernels' products take. Over pipeline stages (pipeline) the first stage has the
    embedding (None on the others), the last one the final norm and the head (None on the others; vocab_size 0)."""

    prepared: PreparedLayers
    embedding: torch.Tensor | None
    head: torch.Tensor | None
    vocab_size: int
    max_rows: int
    head_pairs: torch.Tensor | None = None
    embed_scale: float = 0.0
    logit_cap: float = 0.0
    position_table: torch.Tensor | None = None  # learned positions (OPT): row position + offset is added
    position_offset: int = 0
    # Under tensor parallelism: the group whose ranks each hold the embedding's and head's rows [vocab_start,
    # vocab_start + rows) of the vocabulary (the layers' shards too); the embeddings are summed and the logits
    # gathered over it, so every rank takes the same tokens.
    group: ShmGroup | None = None
    vocab_start: int = 0
    pipeline: PipelinePlace | None = None

    def check(self) -> None:
        """Layers prepared with the final norm, embedding and head (those of this pipeline stage), all of one dtype;
        the head's pairs copy, if given, fits it."""
        prepared, dtype, place = self.prepared, self.prepared.dtype, self.pipeline
        first, last = place is None or place.first, place is None or place.last
        if (prepared.final_norm is None) == last or (self.embedding is None) == first or (self.head is None) == last:
            raise ValueError("greedy decoding needs the embedding on the first stage, the final norm and head on the "
                             "last one, and no others")
        tensors = [(name, tensor) for name, tensor in (("embedding", self.embedding), ("head", self.head))
                   if tensor is not None]
        if self.position_table is not None:
            if self.embedding is None or self.position_table.shape[1:] != self.embedding.shape[1:] or \
                    self.position_offset < 0:
                raise ValueError("the position table must be [positions, hidden] with a non-negative offset")
            tensors.append(("position table", self.position_table))
        for name, tensor in tensors:
            if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != 2 or not tensor.is_contiguous():
                raise ValueError(f"the {name} must be a contiguous CPU matrix of the layers' dtype {dtype}")
        if self.group is not None and self.embedding is not None and self.head is not None and \
                self.embedding.shape[0] != self.head.shape[0]:
            raise ValueError("under tensor parallelism the embedding and the head hold the same vocabulary rows")
        if self.head_pairs is not None and not (dtype == torch.bfloat16 and cpu_gemv.pairs_serve(self.head)
                                                and cpu_gemv.fits_pairs(self.head, self.head_pairs)):
            raise ValueError("head_pairs must be kernels.cpu_gemv.pair_weight of the bf16 head, on a CPU with AVX-512 "
                             "BF16")

    def args(self) -> tuple:
        """module.cpp's ModelArgs."""
        place, table = self.pipeline, self.embedding if self.embedding is not None else self.head
        return (self.prepared.stage_args, pointer(self.embedding), pointer(self.head),
                0 if self.head is None else self.head.shape[0], self.vocab_size, pointer(self.head_pairs),
                self.embed_scale, self.logit_cap, pointer(self.position_table), self.position_offset,
                0 if table is None else table.shape[0], self.vocab_start, self.group,
                None if place is None else (place.world, place.stage, place.stages, place.tp_size))


@dataclass(frozen=True)
class PromptLookupDrafts:
    """Drafts that greedy_decode() proposes and verifies itself: prompt lookup (workers/spec_decode/ngram.py) of up to
    k tokens over each row's history (all its tokens, its last one's included)."""

    k: int
    min_n: int
    max_n: int
    history: Sequence[Sequence[int]]


@dataclass(frozen=True)
class DraftModelDrafts:
    """Drafts that greedy_decode() has a draft model with the target's vocabulary write, up to k per step, as
    workers/spec_decode/draft_model.py drafts them (one token at a time, from its logits processed and drawn as the
    target's): the draft model (its caches over the target's block ids), of the target's dtype. history: each row's
    tokens, as PromptLookupDrafts'; known: int64 [rows], how many of each row's positions the draft's K/V holds (at
    most its last token's position), then updated in place to how many it was fed (those below the row's last
    token's position hold its tokens). After the last step the kernel writes into next (int64 [rows, k]) the k
    drafts of each unconstrained row that goes on with k slots from its last token on (capacity: int64 [rows], the
    positions its blocks and the model length give), -1 for the others; and into next_q (float32 [rows, k, the
    target's vocab_size], needed where a row samples) the distributions a sampled row's were drawn from."""

    k: int
    model: GreedyModel
    history: Sequence[Sequence[int]]
    known: np.ndarray
    capacity: np.ndarray
    next: np.ndarray
    next_q: np.ndarray | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprobs greedy_decode() reports for each token a row takes (of the model's own distribution, as the
    sampler's raw logprobs): ids and values [rows, columns, 1 + most asked] the token's, then its row's best ones
    (-1 ids after them), and ranks [rows, columns] the token's (1 = best); a column as the row's tokens'."""

    ids: np.ndarray
    values: np.ndarray
    ranks: np.ndarray

    def of_row(self, row: int, count: int) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Row's first `count` tokens' [token, best ...] ids, their logprobs and the tokens' ranks, as the sampler's
        gather_logprobs gives them."""
        width = int((self.ids[row, 0] >= 0).sum()) if count else 0
        return (self.ids[row, :count, :width].tolist(), self.values[row, :count, :width].tolist(),
                self.ranks[row, :count].tolist())


@dataclass(frozen=True)
class GreedyRun:
    """greedy_decode()'s result. tokens [rows, columns]: each row's tokens in order, then -1. verified [rows, steps,
    2]: each step's drafted and accepted counts (-1 where the row verified no draft); None without drafts.
    failed [rows]: a sampled row that had no token to draw (a NaN, or no finite logit) and stopped there. logprobs:
    those of the rows that report them (None: no row does). drawn [rows]: how many of its uniform draws each row
    read (None: no row was sampled)."""

    tokens: np.ndarray
    verified: np.ndarray | None
    failed: np.ndarray
    logprobs: TokenLogprobs | None = None
    drawn: np.ndarray | None = None


def greedy_decode(model: GreedyModel, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray,
                  limits: np.ndarray, stops: Sequence[Collection[int]], steps: int,
                  drafts: PromptLookupDrafts | DraftModelDrafts | MtpDrafts | None = None,
                  sampled: SampledRows | None = None, penalized: PenalizedRows | None = None,
                  logprobs: np.ndarray | None = None, adapters: np.ndarray | None = None,
                  masks: GrammarMasks | None = None) -> GreedyRun:
    """Up to `steps` greedy steps for each row from its last token `tokens[m]` at `positions[m]`: per step the
    embedding lookup, the layers with the final norm, the LM head by the GEMV kernel and the first argmax among its
    first vocab_size logits, as the model computes them, all in C++. Row m takes up to limits[m] tokens (its K/V
    slots come from its row of `table`, [rows, max_blocks] block ids) and none after a step that gave it a token of
    stops[m]. With `drafts` a step also feeds each row but a constrained one its drafts (prompt lookup's, a draft
    model's or the MTP layer's: as many as its limit leaves room for, at most the model's max_rows token rows in all)
    and keeps those the argmax agrees with, and the argmax after them: the same tokens. With `sampled` its rows with a
    temperature draw their tokens as the sampler does and verify drafts by its rule (prompt lookup's as one-hot
    guesses, a model's against the distribution q it drew each from, its logits processed as the target's); with
    `penalized` from logits processed as it processes them (each verifying row counting the drafts before it). With
    `logprobs` (int64 [rows]: how many best tokens a row reports beside its own, -1: none) the run's logprobs are
    those of each token a reporting row takes. With `adapters` (int64 [rows]: each row's adapter slot, -1: none) the
    layers add each row's adapter deltas (the prepared layers' slots; a draft model's none). With `masks` its
    constrained rows take only tokens their grammar's mask allows."""
    model.check()
    rows = len(tokens)
    tokens, positions, limits = (np.ascontiguousarray(a, dtype=np.int64) for a in (tokens, positions, limits))
    table = np.ascontiguousarray(table, dtype=np.int64)
    if table.shape[0] != rows or len(positions) != rows or len(limits) != rows or len(stops) != rows:
        raise ValueError("tokens, positions, table, limits and stops need one entry per row")
    stop_ids, stop_starts = flat_lists(stops)
    k = 0 if drafts is None else drafts.k
    if drafts is not None:
        if len(drafts.history) != rows or min(getattr(drafts, "min_n", 1), k) < 1:
            raise ValueError("drafts need a history per row, and k (and prompt lookup's min_n) of 1 at least")
        history, history_starts = flat_lists(drafts.history)
        verified = np.empty((rows, steps, 2), dtype=np.int64)
    else:
        history = history_starts = verified = np.zeros(1, dtype=np.int64)
    draft_model, known = None, np.zeros(1, dtype=np.int64)
    if isinstance(drafts, DraftModelDrafts):
        draft_model, known = _draft_model_args(drafts, model, np.diff(history_starts)), drafts.known
    elif isinstance(drafts, MtpDrafts):
        draft_model = drafts.args(model)
    columns = max(1, min(int(limits.max(initial=0)), steps * (1 + k)))
    pointers: list[int] = []
    drawn = None
    if sampled is not None:
        if isinstance(drafts, DraftModelDrafts) and drafts.next_q is None:
            raise ValueError("a draft model's drafts for sampled rows need next_q")
        arrays = (np.ascontiguousarray(sampled.temperature, dtype=np.float32),
                  np.ascontiguousarray(sampled.top_k, dtype=np.int64),
                  np.ascontiguousarray(sampled.top_p, dtype=np.float32),
                  np.ascontiguousarray(sampled.min_p, dtype=np.float32),
                  np.ascontiguousarray(sampled.draws, dtype=np.float64))
        wide = draw_columns(limits, steps, k, draft_model is not None)
        if any(len(a) != rows for a in arrays) or arrays[4].shape != (rows, wide):
            raise ValueError(f"sampled rows need one temperature, top_k, top_p and min_p per row, and [rows, {wide}] "
                             f"uniform draws")
        drawn = np.empty(rows, dtype=np.int64)
        pointers = [*(a.ctypes.data for a in arrays), arrays[4].shape[1], drawn.ctypes.data]
    processed: tuple[np.ndarray, ...] = ()
    if penalized is not None:
        processed = penalized.arrays(rows)
    out = np.empty((rows, columns), dtype=np.int64)
    grammar: tuple[np.ndarray, ...] = ()
    if masks is not None:
        grammar = masks.arrays(rows)
    reported, width = None, 0
    if logprobs is not None:
        logprobs = np.ascontiguousarray(logprobs, dtype=np.int64)
        if logprobs.shape != (rows,):
            raise ValueError("logprobs need one count per row (-1: none)")
        width = 1 + min(int(logprobs.max(initial=0)), model.vocab_size)
        reported = TokenLogprobs(np.empty((rows, columns, width), dtype=np.int64),
                                 np.empty((rows, columns, width), dtype=np.float32),
                                 np.empty((rows, columns), dtype=np.int64))
    if adapters is not None:
        adapters = np.ascontiguousarray(adapters, dtype=np.int64)
        if adapters.shape != (rows,):
            raise ValueError("adapters need one slot per row (-1: none)")
    prepared = model.prepared
    prepared.module.greedy_decode(
        prepared.dtype == torch.bfloat16, model.args(), tokens.ctypes.data, positions.ctypes.data, table.ctypes.data,
        table.shape[1], prepared.block_size, limits.ctypes.data, stop_ids.ctypes.data, stop_starts.ctypes.data,
        [k, getattr(drafts, "min_n", 1), getattr(drafts, "max_n", 0)], history.ctypes.data,
        history_starts.ctypes.data, verified.ctypes.data if drafts else 0, pointers,
        [a.ctypes.data for a in processed], [a.ctypes.data for a in grammar],
        0 if masks is None else masks.bits.shape[1], (lambda: masks.before_step(out)) if masks else _nothing,
        [] if reported is None else [a.ctypes.data for a in (logprobs, reported.ids, reported.values, reported.ranks)],
        width, 0 if adapters is None else adapters.ctypes.data, draft_model, known.ctypes.data,
        max(rows, model.max_rows), out.ctypes.data, columns, rows, steps)
    return GreedyRun(out, verified if drafts else None, (out == -2).any(axis=1), reported, drawn)


def draw_columns(limits: np.ndarray, steps: int, k: int, drafted: bool = False) -> int:
    """The most uniform draws a sampled row reads in greedy_decode() for `steps` steps of up to k drafts each: one a
    step without drafts, else an accept and a uniform draw for each of up to 1 + k token rows, and where a draft
    model draws the drafts one for each, and k for the next call's (a row takes a token a step at least, so no more
    steps than its limit)."""
    per_step = 1 if k == 0 else 2 * (1 + k) + k * drafted
    return max(1, min(int(np.max(limits, initial=0)), steps)) * per_step + k * drafted


def _draft_model_args(drafts: DraftModelDrafts, target: GreedyModel, lengths: np.ndarray) -> tuple:
    """The draft model as the kernel takes it (module.cpp's DraftArgs), once it is found to fit the target's steps
    (its tokens within the target's vocabulary; lengths: each row's history length)."""
    draft = drafts.model
    draft.check()
    if draft.prepared.dtype != target.prepared.dtype:
        raise TypeError(f"the draft was prepared for {draft.prepared.dtype}, not the target's {target.prepared.dtype}")
    if draft.vocab_size > target.vocab_size:  # the driver's stage has the head (its embedding may be elsewhere)
        raise ValueError("the draft's vocabulary must be the target's")
    if draft.prepared.block_size != target.prepared.block_size:
        raise ValueError("the draft's caches must have the target's block size (they share its block table)")
    for name, shape in (("known", lengths.shape), ("capacity", lengths.shape), ("next", (len(lengths), drafts.k))):
        array = getattr(drafts, name)
        if not (isinstance(array, np.ndarray) and array.dtype == np.int64 and array.flags.c_contiguous
                and array.flags.writeable and array.shape == shape):
            raise ValueError(f"{name} must be a writable contiguous int64 array of shape {shape}")
    if not ((drafts.known >= 0) & (drafts.known < lengths)).all():
        raise ValueError("a row's draft K/V must be known up to its last token's position at most")
    next_q = drafts.next_q
    if next_q is not None:
        shape = (len(lengths), drafts.k, target.vocab_size)
        if not (isinstance(next_q, np.ndarray) and next_q.dtype == np.float32 and next_q.flags.c_contiguous
                and next_q.flags.writeable and next_q.shape == shape) or draft.vocab_size > target.vocab_size:
            raise ValueError(f"next_q must be a writable contiguous float32 array of shape {shape}, over a draft "
                             f"vocabulary within the target's")
    return (draft.args(), drafts.capacity.ctypes.data, drafts.next.ctypes.data,
            0 if next_q is None else next_q.ctypes.data, None)


def _nothing() -> None:
    """No grammar: no host work before a step."""
