"""Typed reads of parsed JSON, for the round trips of the files fp8kv writes (fp8kv.json, report.json):
field by field, or a whole frozen dataclass read as its type hints say.

A wrong type or a missing key raises TypeError or KeyError naming the key; each reader turns that
into one `Fp8kvError` naming its file.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, fields, is_dataclass
from types import UnionType
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Kind = type | tuple[type, ...]
T = TypeVar("T", bound="DataclassInstance")


def json_object(value: Any, what: str = "an entry") -> dict[str, Any]:
    """`value` when it is a JSON object."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not an object")
    return value


def typed(data: Any, key: str, kind: Kind, optional: bool = False) -> Any:
    """`data[key]` when it is a `kind`; a missing or null `optional` key is None."""
    value = json_object(data).get(key) if optional else json_object(data)[key]
    if value is None and optional:
        return None
    return checked(value, kind, repr(key))


def checked(value: Any, kind: Kind, what: str) -> Any:
    """`value` when it is a `kind`; JSON's true and false are no numbers."""
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(f"{what} is {type(value).__name__}, not {expected}")
    return value


def to_json_value(value: Any) -> Any:
    """A dataclass (nested ones too), tuple, dict or number as JSON values: tuples as lists, NaN/inf as null."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json_value(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    return value


def from_json_value(kind: Any, value: Any, what: str) -> Any:
    """`value` read as the type hint `kind`: str, int, bool, float (null, written for NaN/inf, reads as NaN),
    `X | None`, `X | tuple[X, ...]` (by whether the value is a list), tuple[X, ...], list[X], dict[str, X], a
    dataclass (see `dataclass_from_json`) or Any."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1:  # a number or a list of them: the JSON value says which
            inner = [a for a in inner if (get_origin(a) in (tuple, list)) == isinstance(value, list)]
        (chosen,) = inner
        return from_json_value(chosen, value, what)
    if kind is float:
        return math.nan if value is None else float(checked(value, (int, float), what))
    if kind in (str, int, bool):
        return checked(value, kind, what)
    if origin in (tuple, list):
        items = [from_json_value(args[0], v, f"an item of {what}") for v in checked(value, list, what)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        return {k: from_json_value(args[1], v, f"{what}[{k!r}]") for k, v in json_object(value, what).items()}
    if isinstance(kind, type) and is_dataclass(kind):
        return dataclass_from_json(kind, value, what)
    if kind is Any:
        return value
    raise TypeError(f"{what}: no JSON reading of {kind}")


def dataclass_from_json(cls: type[T], data: Any, what: str = "an entry") -> T:
    """`cls` from the JSON object `to_json_value` wrote, each field read as its type hint says; a missing
    field with a default keeps it."""
    data, hints = json_object(data, what), get_type_hints(cls)
    values = {f.name: from_json_value(hints[f.name], data[f.name], repr(f.name)) for f in fields(cls)
              if f.init and (f.name in data or (f.default is MISSING and f.default_factory is MISSING))}
    return cls(**values)
