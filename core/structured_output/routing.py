"""Which backend compiles a JSON schema: xgrammar, unless the schema uses a keyword xgrammar drops or gets wrong;
then llguidance, which enforces it or refuses it by name (never silently ignores it)."""
from __future__ import annotations

from typing import Any

from core.structured_output.formats import EXACT_FORMATS
from core.structured_output.schema_tree import subschemas

# Keywords xgrammar 0.2 enforces correctly (checked against its generated grammars), and annotations that
# constrain nothing. minLength/maxLength are missing on purpose: xgrammar then lets raw control characters into
# the string, which is not JSON.
XGRAMMAR_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "pattern", "format",
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly"})
XGRAMMAR_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "uuid",
    "json-pointer"})


def json_schema_backend(schema: dict[str, Any]) -> str:
    """"xgrammar" when it enforces every keyword of the schema, else "guidance"."""
    return "xgrammar" if all(_xgrammar_enforces(s) for s in subschemas(schema)) else "guidance"


def _xgrammar_enforces(schema: dict[str, Any]) -> bool:
    value = schema.get("format")
    # its exact pattern cannot join another one in xgrammar
    if isinstance(value, str) and value in EXACT_FORMATS and "pattern" in schema:
        return False
    format_ok = value is None or (isinstance(value, str) and value in XGRAMMAR_FORMATS)
    return format_ok and XGRAMMAR_KEYWORDS.issuperset(schema)
