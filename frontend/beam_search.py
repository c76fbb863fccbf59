"""Beam search over the engine, step for step as transformers' `generate(num_beams=...)` does it."""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from frontend.outputs import Logprob, RequestOutput
from ipc import EngineInfo, SamplingParams

# Each step asks the engine for 2 * beam_width top logprobs per beam, and the engine gives at most 20.
MAX_BEAM_WIDTH = 10
EARLY_STOPPING_VALUES = (True, False, "never")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams plus transformers' `early_stopping`; invalid values raise ValueError naming the field.

    `eos_token_id` overrides the tokenizer's EOS (None: the tokenizer's); `ignore_eos` lets beams run past it.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            _require(_is_int(getattr(self, name)), name, "must be an int")
        _require(1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
                 f"must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        penalty = self.length_penalty
        _require(isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and math.isfinite(penalty),
                 "length_penalty", f"must be a finite number, got {penalty!r}")
        _require(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
                 f"must be one of {EARLY_STOPPING_VALUES}, got {self.early_stopping!r}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        _require(self.eos_token_id is None or (_is_int(self.eos_token_id) and self.eos_token_id >= 0),
                 "eos_token_id", f"must be a non-negative int or None, got {self.eos_token_id!r}")

    def step_sampling_params(self) -> SamplingParams:
        """What each beam asks the engine for per step: one greedy token and the top 2 * beam_width candidates."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One hypothesis; `tokens` holds prompt and generated tokens (vLLM's layout), `text` the generated text."""

    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_length ** length_penalty: what beams are ranked by
    finish_reason: str  # "stop" (ended by EOS, which `tokens` keeps and `text` leaves out) or "length"
    text: str = ""


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Beam:
    token_ids: list[int]  # generated so far
    cum_logprob: float


class BeamSearch:
    """The beams of one prompt. Each step: of every live beam's top candidates keep the best 2 * beam_width by
    cumulative logprob; those among the best beam_width that end in EOS (or reach max_tokens) become finished
    hypotheses, the best beam_width others live on."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, tokenizer_eos: int | None,
                 info: EngineInfo) -> None:
        if len(prompt_token_ids) + params.max_tokens > info.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; with max_tokens={params.max_tokens} "
                             f"that exceeds max_model_len ({info.max_model_len}): shorten one of them")
        eos = params.eos_token_id if params.eos_token_id is not None else tokenizer_eos
        if eos is not None and eos >= info.vocab_size:
            raise ValueError(f"eos_token_id {eos} is outside the vocabulary [0, {info.vocab_size})")
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos
        self.running = [_Beam([], 0.0)]
        self.finished: list[tuple[float, _Beam]] = []  # (score, hypothesis), best first, at most beam_width
        self.done = False

    def beam_prompts(self) -> list[list[int]]:
        """The token ids to run this step, one list per live beam (in `running` order)."""
        return [self.prompt_token_ids + beam.token_ids for beam in self.running]

    def step(self, top_logprobs: list[dict[int, Logprob]]) -> None:
        """Take in each live beam's top next tokens (in `running` order) and move the search one token on."""
        width = self.params.beam_width
        candidates = self._best_candidates(top_logprobs)
        stops = [self._hits_stop(beam) for beam in candidates]
        self.running = [beam for beam, stop in zip(candidates, stops) if not stop][:width]
        # Only the best beam_width candidates may finish; the rest only stand by to keep beam_width beams alive.
        self._add_finished([beam for beam, stop in zip(candidates[:width], stops[:width]) if stop])
        self.done = self._is_done(len(candidates[0].token_ids))

    def output(self, tokenizer: PreTrainedTokenizerBase) -> BeamSearchOutput:
        return BeamSearchOutput([self._sequence(score, beam, tokenizer) for score, beam in self.finished])

    def _best_candidates(self, top_logprobs: list[dict[int, Logprob]]) -> list[_Beam]:
        candidates = [_Beam(beam.token_ids + [token_id], beam.cum_logprob + logprob.logprob)
                      for beam, top in zip(self.running, top_logprobs) for token_id, logprob in top.items()]
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        return candidates[:2 * self.params.beam_width]

    def _hits_stop(self, beam: _Beam) -> bool:
        return beam.token_ids[-1] == self.eos_token_id or len(beam.token_ids) == self.params.max_tokens

    def _score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / length ** self.params.length_penalty

    def _add_finished(self, beams: list[_Beam]) -> None:
        self.finished += [(self._score(beam.cum_logprob, len(beam.token_ids)), beam) for beam in beams]
        self.finished.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del self.finished[self.params.beam_width:]

    def _is_done(self, length: int) -> bool:
        """transformers' stop rule: max_tokens reached; with early_stopping=True, beam_width hypotheses; else when
        beam_width hypotheses are in and the best live beam cannot beat the worst of them (its best possible
        length taken as the current one, or max_tokens for early_stopping="never" with a positive penalty)."""
        params = self.params
        if length == params.max_tokens or not self.running:
            return True
        if len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        never = params.early_stopping == "never" and params.length_penalty > 0
        best_possible = self._score(self.running[0].cum_logprob, params.max_tokens if never else length)
        return best_possible <= self.finished[-1][0]

    def _sequence(self, score: float, beam: _Beam, tokenizer: PreTrainedTokenizerBase) -> BeamSearchSequence:
        stopped = bool(beam.token_ids) and beam.token_ids[-1] == self.eos_token_id
        text_ids = beam.token_ids[:-1] if stopped else beam.token_ids
        return BeamSearchSequence(self.prompt_token_ids + beam.token_ids, beam.cum_logprob, score,
                                  "stop" if stopped else "length", tokenizer.decode(text_ids, skip_special_tokens=True))


def live_beams(searches: list[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]]]:
    """The searches not done yet and the token ids of every live beam of theirs: one step's one-token requests."""
    live = [search for search in searches if not search.done]
    return live, [ids for search in live for ids in search.beam_prompts()]


def take_step(live: list[BeamSearch], outputs: Iterator[RequestOutput]) -> None:
    """Move each live search one token on from its beams' outputs (in live_beams()'s order)."""
    for search in live:
        search.step([next(outputs).outputs[0].logprobs[0] for _ in search.running])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"BeamSearchParams.{field} {message}")
