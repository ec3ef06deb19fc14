"""What `fp8kv calibrate` shows: a progress bar on stderr, then a per-layer table or a JSON summary."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fp8kv.calibrate.pipeline import CalibrationResult, Progress as ProgressCallback


def command_line() -> str:
    """The command as typed, for the provenance record."""
    return shlex.join(["fp8kv", *sys.argv[1:]])


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[ProgressCallback]:
    """A callback that advances a 'calibrating' bar on stderr; library progress bars are silenced."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    columns = (TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not enabled, transient=True) as bar:
        task = bar.add_task("calibrating", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance


def show(result: CalibrationResult, json_output: bool = False) -> None:
    """Print the per-layer table (or JSON on stdout); the fallback note and warnings go to stderr."""
    err = Console(stderr=True)
    for line in ([result.note] if result.note else []) + result.warnings:
        err.print(f"fp8kv: {line}", highlight=False)
    if json_output:
        summary = {"out": str(result.out) if result.out else None, **result.provenance}
        print(json.dumps(summary, indent=2))
        return
    prov = result.provenance
    table = Table(title=f"{prov['kv_dtype']} K/V scales ({prov['strategy']}, {prov['dataset']['num_samples']} samples, "
                  f"{prov['dataset']['num_tokens']} tokens)")
    for name in ("layer", "K amax", "k_scale", "K sat.", "V amax", "v_scale", "V sat."):
        table.add_column(name, justify="right")
    for row in prov["layers"]:
        table.add_row(
            str(row["layer"]),
            f"{row['k_amax']:.6g}", f"{row['k_scale']:.6g}", f"{row['k_saturation']:.3%}",
            f"{row['v_amax']:.6g}", f"{row['v_scale']:.6g}", f"{row['v_saturation']:.3%}",
        )
    console = Console()
    console.print(table)
    if prov["skipped_layers"]:
        console.print(f"layers without their own KV cache (no scale): {prov['skipped_layers']}")
    if result.out is not None:
        console.print(f"wrote {result.out} ({prov['format']})")
