"""Exact patterns for the date and time string formats, which both backends approximate (xgrammar lets any month
have 31 days, llguidance any year a 29 February): a schema's format becomes its pattern before compiling."""
from __future__ import annotations

import json

from core.structured_output.schema_tree import subschemas

_YEAR = r"(\d{3}[1-9]|\d{2}[1-9]0|\d[1-9]00|[1-9]000)"  # 0001-9999, as Python's and most validators' dates
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_LEAP_YEAR = r"(\d{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"  # RFC 3339 full-time
EXACT_FORMATS = {"date": DATE, "time": TIME, "date-time": f"{DATE}T{TIME}"}


def with_exact_formats(schema_text: str) -> str:
    """The schema with each date/time/date-time format that has no pattern beside it turned into its pattern (a
    format with a pattern goes to llguidance, which checks days per month but not leap years: routing)."""
    schema = json.loads(schema_text)
    changed = False
    for subschema in subschemas(schema):
        pattern = EXACT_FORMATS.get(subschema.get("format")) if isinstance(subschema.get("format"), str) else None
        if pattern is not None and "pattern" not in subschema:
            del subschema["format"]
            subschema["pattern"] = f"^{pattern}$"
            changed = True
    return json.dumps(schema, ensure_ascii=False) if changed else schema_text
