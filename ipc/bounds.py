"""The bounded field types of the contracts between processes, and the check that applies them on construction.

msgspec enforces each `Meta` bound whenever a message is decoded, whichever client sent it; `check_fields` applies
the same bounds to a Struct built in Python; the gateway's pydantic models mirror them (frontend/api/bounds.py).
So each limit is written once, here or on the field that carries it.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
from msgspec import Meta

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_ID_LENGTH = 512  # request ids, cache salts: a client's strings the engine keeps per request
MAX_PROMPT_TOKENS = 2**24
MAX_VOCAB_ENTRIES = 2**18  # per-token maps (logit_bias): no vocabulary is larger

TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]  # a duration or a Unix time: finite, never negative
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
RequestId = Annotated[str, Meta(max_length=MAX_ID_LENGTH)]


def check_fields(struct: msgspec.Struct, prefix: str = "") -> None:
    """Raise ValueError naming the first field (after `prefix`) whose value breaks its type or bounds, as decoding
    would; values msgspec normalises (an enum's value, a tuple for a list) are stored normalised."""
    for name, field_type in _field_types(type(struct)):
        value = getattr(struct, name)
        try:
            converted = msgspec.convert(value, field_type)
        except msgspec.ValidationError as error:
            raise ValueError(f"{prefix}{name} is invalid: {error} (got {_short(value)})") from None
        if converted is not value and not isinstance(value, msgspec.Struct):
            setattr(struct, name, converted)


@functools.cache
def _field_types(struct_type: type) -> tuple[tuple[str, Any], ...]:
    return tuple((field.name, field.type) for field in msgspec.structs.fields(struct_type))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
