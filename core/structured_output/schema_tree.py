"""A JSON schema's subschemas, walked without recursion (a hostile schema may nest deeper than the stack)."""
from __future__ import annotations

from typing import Any

# Where a schema holds subschemas: one, a list of them, or a name → subschema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(schema: Any) -> list[dict[str, Any]]:
    """The schema and every schema nested in it (iteratively: a hostile schema may nest deeper than the stack)."""
    found, stack = [], [schema]
    while stack:
        current = stack.pop()
        if not isinstance(current, dict):
            continue
        found.append(current)
        stack += [current[key] for key in _ONE if isinstance(current.get(key), dict)]
        stack += [item for key in _LIST if isinstance(current.get(key), list) for item in current[key]]
        stack += [item for key in _MAP if isinstance(current.get(key), dict) for item in current[key].values()]
    return found
