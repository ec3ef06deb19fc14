"""The `fp8kv` command line. Commands are thin: they parse options and call library functions."""

from __future__ import annotations

import os

import click
import typer
from typer.core import TyperGroup

from fp8kv import __version__
from fp8kv.errors import Fp8kvError

DEBUG_ENV = "FP8KV_DEBUG"


class UserError(click.ClickException):
    """One line on stderr and exit code 2, for errors the user can fix."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"fp8kv: error: {self.message}", err=True)


class _Group(TyperGroup):
    """Turns the project's error type (and OS errors) into one line; FP8KV_DEBUG=1 shows tracebacks."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (Fp8kvError, OSError) as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            raise UserError(_one_line(exc)) from None


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split("\n"))


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Calibrate, verify and publish static FP8 KV-cache scales for Hugging Face checkpoints.",
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"fp8kv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Calibrate, verify and publish static FP8 KV-cache scales for Hugging Face checkpoints."""


def main() -> None:
    app(prog_name="fp8kv")
