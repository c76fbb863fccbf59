"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names), and the step's masks."""
from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipc.bounds import check_fields

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar's text: far past any real one, bounded for the engine
MAX_CHOICES = 4096

ConstraintText = Annotated[str, Meta(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


MAX_MARKER_TOKENS = 16


class ReasoningSection(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Where the output's reasoning section (e.g. <think>...</think>) lies, so that a constraint applies after it
    and never inside it. The section ends once the output's tokens end with `end_token_ids`. Without
    `open_token_id` the output begins inside the section; with it, the section exists only if the output's first
    token is that one (allowed there beside what the constraint allows); otherwise the constraint applies from the
    first token."""

    end_token_ids: Annotated[list[int], Meta(min_length=1, max_length=MAX_MARKER_TOKENS)]
    open_token_id: int | None = None


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Exactly one of: a JSON schema (`json`, an object or its JSON text), a `regex` the whole output matches, a
    `choice` of literal strings, an EBNF/GBNF `grammar` (root rule `root`), `json_object` (any JSON object), or
    xgrammar's `structural_tag` (its JSON text: {"type": "structural_tag", "format": {...}})."""

    json: dict[str, Any] | ConstraintText | None = None  # a dict is stored as its JSON text
    regex: ConstraintText | None = None
    choice: Annotated[list[Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: ConstraintText | None = None
    json_object: bool = False
    structural_tag: ConstraintText | None = None
    # JSON is written with single spaces after "," and ":" and no other whitespace unless this is False (then any
    # amount is allowed, which lets a weak model fill max_tokens with blanks): a default on purpose unlike vLLM's.
    disable_any_whitespace: bool = True
    reasoning: ReasoningSection | None = None  # set by a reasoning parser (the gateway's --reasoning-parser)

    def __post_init__(self) -> None:
        check_fields(self, "structured_outputs.")
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) or 'none'}")
        if isinstance(self.json, dict):
            # Carried as JSON text: any JSON value survives it (msgpack has no integers past 64 bits).
            try:
                self.json = json.dumps(self.json, allow_nan=False, ensure_ascii=False)
            except (TypeError, ValueError) as error:
                raise ValueError(f"structured_outputs.json is not JSON: {error}") from None
            if len(self.json) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.json is over {MAX_CONSTRAINT_CHARS} characters as JSON")
        if self.structural_tag is not None:
            try:
                tag = json.loads(self.structural_tag)
            except ValueError as error:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {error}") from None
            if not (isinstance(tag, dict) and tag.get("type") == "structural_tag"):
                raise ValueError('structured_outputs.structural_tag must be a JSON object of type "structural_tag"')
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema: a JSON object")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a canonical JSON schema, the regex, the choices as JSON, or the grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "choice":
            return json.dumps(value, ensure_ascii=False)
        return "" if value is True else value

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.disable_any_whitespace


class GrammarBitmask(msgspec.Struct, kw_only=True):
    """The step's allowed tokens for each constrained request that samples in it: row i (int32 words, bit j of
    word w allows token 32 * w + j) belongs to req_ids[i]."""

    req_ids: list[str]
    words_per_row: int
    packed: bytes  # little-endian int32, len(req_ids) * words_per_row of them
