"""SamplingParams: how one request is sampled and when it stops, validated on construction."""
from __future__ import annotations

import enum

import msgspec

_MAX_LOGPROBS = 20
_GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(str, enum.Enum):
    """What a streaming front end emits per step: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM-compatible sampling parameters; invalid values raise ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id → added to its logit before sampling (OpenAI's rule)
    bad_words: list[str] | None = None  # never generated (each as it tokenizes alone and after a space)
    # The bad words as token-id sequences: set by the front end, which owns the tokenizer.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        self._check_ranges()

    def _check_types(self) -> None:
        ints = {"n": self.n, "top_k": self.top_k, "min_tokens": self.min_tokens}
        for name, value in ints.items():
            _require(isinstance(value, int) and not isinstance(value, bool), name, "must be an int")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool), name, "must be a number")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            _require(ok, name, "must be an int or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, "must be a bool")
        kinds = [kind.value for kind in RequestOutputKind]
        _require(self.output_kind in kinds, "output_kind", f"must be one of {kinds}, got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        _require(self.stop is None or all(isinstance(s, str) for s in self.stop), "stop", "must be strings")
        _require(self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words), "bad_words",
                 "must be non-empty strings")
        bias = self.logit_bias
        _require(bias is None or (isinstance(bias, dict) and all(
            isinstance(t, int) and not isinstance(t, bool) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for t, v in bias.items())), "logit_bias", "must map token ids (ints) to numbers")
        ids = self.stop_token_ids
        _require(ids is None or all(isinstance(t, int) and t >= 0 for t in ids), "stop_token_ids",
                 "must be non-negative ints")

    def _check_ranges(self) -> None:
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0 or self.top_k == -1, "top_k", f"must be 0 or -1 (off) or >= 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2.0 <= getattr(self, name) <= 2.0, name, f"must be in [-2, 2], got {getattr(self, name)}")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0 (1 is off), got {self.repetition_penalty}")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(self.seed is None or -2**63 <= self.seed < 2**64, "seed", f"must fit in 64 bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= _MAX_LOGPROBS, name, f"must be in [0, {_MAX_LOGPROBS}], got {value}")
        _require(not self.stop or all(self.stop), "stop", "must not contain empty strings")
        _require(not self.logit_bias or all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                 "values must be in [-100, 100]")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """Temperature ~0 means argmax (vLLM's rule); top_k=1 reaches the same token through the sampler."""
        return self.temperature < _GREEDY_TEMPERATURE


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")
