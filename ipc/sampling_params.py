"""SamplingParams: how one request is sampled and when it stops, validated on construction."""
from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from ipc.bounds import INT32_MAX, MAX_VOCAB_ENTRIES, Fraction, Int64, TokenId, check_fields
from ipc.structured_outputs import StructuredOutputsParams

MAX_N = 1024
MAX_TEMPERATURE = 100.0  # past this every distribution is flat to float precision; Infinity is refused
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 1024  # the contract's bound; each engine allows at most its own max_logprobs (default 20)
MAX_STOP_STRINGS = 1024
MAX_BAD_WORDS = 1024
_MAX_TEXT = 4096

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
LogitBias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Text = Annotated[str, Meta(min_length=1, max_length=_MAX_TEXT)]  # one stop string or bad word
BadWordTokens = Annotated[list[TokenId], Meta(min_length=1, max_length=_MAX_TEXT)]
_GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(str, enum.Enum):
    """What a streaming front end emits per step: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM-compatible sampling parameters; invalid values raise ValueError naming the field.

    Each field's type carries its bounds (msgspec enforces them when a message is decoded, `check_fields` when
    one is built here). A top_k at or above the vocabulary size samples from the whole vocabulary.
    """

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] = 0  # 0 or -1: off
    min_p: Fraction = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Bounded away from 0 as from infinity: dividing logits by a tiny penalty overflows them to inf.
    repetition_penalty: Annotated[float, Meta(ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] = 1.0  # 1: off
    seed: Int64 | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = 16
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    stop: Annotated[list[Text], Meta(max_length=MAX_STOP_STRINGS)] | Text | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # token id → added to its logit before sampling (OpenAI's rule)
    logit_bias: Annotated[dict[TokenId, LogitBias], Meta(max_length=MAX_VOCAB_ENTRIES)] | None = None
    # Never generated (each as it tokenizes alone and after a space).
    bad_words: Annotated[list[Text], Meta(max_length=MAX_BAD_WORDS)] | None = None
    # The bad words as token-id sequences: set by the front end, which owns the tokenizer.
    bad_words_token_ids: Annotated[list[BadWordTokens], Meta(max_length=2 * MAX_BAD_WORDS)] | None = None
    # The output must satisfy this (a JSON schema, regex, choice or grammar): the engine masks every other token.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_fields(self, "SamplingParams.")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """Temperature ~0 means argmax (vLLM's rule); top_k=1 reaches the same token through the sampler."""
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def logits_as_they_are(self) -> bool:
        """Whether its tokens come from the model's logits as they are, the argmax or drawn by temperature, top-k,
        top-p and min-p: no penalty, bias or ban changes them (min_tokens aside: it depends on the output so far)."""
        return not self.bad_words_token_ids and not self.has_penalties and not self.logit_bias


def stop_tokens(params: SamplingParams, eos_token_id: int | None) -> set[int]:
    """The tokens that end a request once it has min_tokens outputs: its stop tokens, and EOS unless ignored. The
    token half of the stop rule, in one place: the scheduler's stop check, the worker's later steps and (through
    the sets they give it) the C++ steps."""
    stops = set(params.stop_token_ids or ())
    if eos_token_id is not None and not params.ignore_eos:
        stops.add(eos_token_id)
    return stops


def tokens_left(max_tokens: int | None, num_output_tokens: int, max_model_len: int, num_tokens: int) -> int:
    """How many more tokens a request may take before it finishes by length: up to its max_tokens (None: no limit
    of its own) and the model's context. The length half of the stop rule, in one place: the scheduler's stop check
    and lookahead, the multi-step planner, the worker's later steps and (through the limits they give it) the C++
    steps all count with it."""
    left = max_model_len - num_tokens
    return left if max_tokens is None else min(left, max_tokens - num_output_tokens)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")
