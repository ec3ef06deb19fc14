"""Typer's side of fp8kv's option parsing, shared by `cli.py` and `cli_conformance.py`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import typer
from typer.core import TyperCommand

from fp8kv.errors import Fp8kvError

T = TypeVar("T")


def checked(parse: Callable[[T], object]) -> Callable[[T | None], T | None]:
    """A typer callback running fp8kv's own parser on an option's value: a bad value is a usage error (exit 2)
    before anything heavy is imported."""
    def callback(value: T | None) -> T | None:
        if value is not None:
            try:
                parse(value)
            except Fp8kvError as exc:
                raise typer.BadParameter(re.sub(r"^--[\w-]+ ", "", str(exc))) from None
        return value

    return callback


class Command(TyperCommand):
    """A command whose usage line names its arguments as their help does (MODEL, DIR), without typer's braces,
    and whose errors on a value outside an option's choices read as fp8kv's own."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as exc:
            # typer checks a Literal option through pydantic, whose message starts with its error kind
            if not exc.message.startswith(_PYDANTIC_PREFIX):
                raise
            raise typer.BadParameter(exc.message.removeprefix(_PYDANTIC_PREFIX), ctx=exc.ctx, param=exc.param,
                                     param_hint=exc.param_hint) from None


_PYDANTIC_PREFIX = "Value error, "
