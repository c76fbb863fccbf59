"""The engine contracts' msgspec bounds as pydantic types, so the gateway refuses what the engine would, early (400)."""
from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Annotated, Any

import msgspec
from pydantic import Field

_CONSTRAINTS = ("ge", "gt", "le", "lt", "min_length", "max_length")


class Mirrored:
    """`Mirrored(SamplingParams)["top_k"]`: the pydantic type of that field, with the same bounds."""

    def __init__(self, struct_type: type[msgspec.Struct]) -> None:
        self.types = {field.name: field.type for field in msgspec.structs.fields(struct_type)}

    def __getitem__(self, field_name: str) -> Any:
        return mirror(self.types[field_name])


def mirror(tp: Any) -> Any:
    """A msgspec type as a pydantic one: each `Meta` bound becomes a `Field` bound, and floats must be finite."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, *extras = args
        limits = {name: value for meta in extras if isinstance(meta, msgspec.Meta)
                  for name in _CONSTRAINTS if (value := getattr(meta, name)) is not None}
        if base is float:
            limits["allow_inf_nan"] = False
        return Annotated[mirror(base), Field(**limits)]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, (mirror(arg) for arg in args))
    if origin in (list, dict):
        return origin[tuple(mirror(arg) for arg in args)]
    return tp
