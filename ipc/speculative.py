"""SpeculativeConfig: how the engine proposes draft tokens for the target model to verify (vLLM's names)."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.bounds import check_fields

METHODS = ("ngram", "draft_model", "mtp")
DraftLength = Annotated[int, Meta(ge=1, le=32)]
NgramLength = Annotated[int, Meta(ge=1, le=1024)]


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`ngram`: prompt lookup (the longest suffix of the request's tokens, between prompt_lookup_min and
    prompt_lookup_max long, that occurred before proposes the tokens that followed it). `draft_model`: `model`, a
    smaller model folder with the same vocabulary, writes the drafts one token at a time. `mtp`: the target's own
    multi-token-prediction layer (DeepSeek-V3's num_nextn_predict_layers) drafts from its hidden states, applied
    again to its own output for each further draft."""

    method: Literal["ngram", "draft_model", "mtp"]
    num_speculative_tokens: DraftLength
    model: str | None = None
    prompt_lookup_max: NgramLength = 4
    prompt_lookup_min: NgramLength = 2
    # Steps with more requests than this verify no drafts: on CPU a step of a few rows already fills the cores, so
    # drafts' rows cost nearly what they save. `python benchmarks/spec_decode.py --cutoff-sweep 1 2 4 8 --requests 4`
    # (demo model, prompt lookup k = 7 verified in the C++ greedy steps, multi-step calls sized by their time
    # budget, 2-core AVX-512 BF16 EPYC; medians of the rounds' ratios, edit / free workload): 1.51x / 1.44x at 1
    # request, 1.00x / 0.93x at 2, 0.97x / 0.85x at 4, 0.74x / 0.79x at 8: past 1 it no longer gains. (With 8-step
    # calls the plain engine paid more per token at 2-4 requests, and speculation gained up to 4.) Measured on CPU:
    # where verification rows come nearly free (a GPU), raise it.
    disable_by_batch_size: Annotated[int, Meta(ge=1)] | None = 1

    def __post_init__(self) -> None:
        check_fields(self, "speculative_config.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model (the draft model's folder) is required by method "
                             "'draft_model' and only by it")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a step's tokens that its proposer writes: a draft model or MTP layer feeds its own drafts."""
        return self.num_speculative_tokens if self.method in ("draft_model", "mtp") else 0


def parse_speculative_config(value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from itself, a dict (LLM's keyword) or JSON text (the CLI flag); ValueError names what
    is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"speculative_config is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
    if value.get("method") not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {value.get('method')!r}")
    try:
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as error:
        raise ValueError(f"speculative_config is invalid: {error}") from None
