"""Typed reads of parsed JSON, for the round trips of the files fp8kv writes (fp8kv.json, report.json).

A wrong type or a missing key raises TypeError or KeyError naming the key; each reader turns that
into one `Fp8kvError` naming its file.
"""

from __future__ import annotations

from typing import Any

Kind = type | tuple[type, ...]


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
