"""SpeculativeConfig: how the engine proposes draft tokens for the target model to verify (vLLM's names)."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.bounds import check_fields

METHODS = ("ngram", "draft_model")
DraftLength = Annotated[int, Meta(ge=1, le=32)]
NgramLength = Annotated[int, Meta(ge=1, le=1024)]


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`ngram`: prompt lookup (the longest suffix of the request's tokens, between prompt_lookup_min and
    prompt_lookup_max long, that occurred before proposes the tokens that followed it). `draft_model`: `model`, a
    smaller model folder with the same vocabulary, writes the drafts one token at a time."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: DraftLength
    model: str | None = None
    prompt_lookup_max: NgramLength = 4
    prompt_lookup_min: NgramLength = 2
    # Steps with more requests than this verify no drafts: on CPU the verification cost grows with the batch.
    # `python benchmarks/spec_decode.py --cutoff-sweep 1 2 4 8 12 16` and `... 8 16 24 32 64` (demo model, k = 4, 2-core
    # AVX2 CPU, the GEMM tiles of kernels/csrc/gemm.h; medians of rounds): prompt lookup 1.4-1.9x at 1-4 requests,
    # 1.04-1.24x at 8-24, at 32 and 64 1.02-1.15x and 1.04x with single rounds below 1: past 24 it stops paying
    # reliably.
    disable_by_batch_size: Annotated[int, Meta(ge=1)] | None = 24

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
        """KV slots past a step's tokens that its proposer writes: a draft model feeds its own drafts."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


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
