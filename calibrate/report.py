"""What `fp8kv calibrate` shows when done: a per-layer table or a JSON summary, and the next command."""

from __future__ import annotations

import json
import shlex
import sys

from rich.table import Table

from fp8kv.calibrate.pipeline import CalibrationResult
from fp8kv.console import text_console


def command_line() -> str:
    """The command as typed, for the provenance record."""
    return shlex.join(["fp8kv", *sys.argv[1:]])


def show(result: CalibrationResult, json_output: bool = False) -> None:
    """Print the per-layer table (or JSON on stdout) and the next command; warnings go to stderr.

    The data note was announced before the work (`StageProgress.note`); it is in the provenance too.
    """
    err = text_console(stderr=True)
    for line in result.warnings:
        err.print(f"fp8kv: {line}", highlight=False)
    if json_output:
        summary = {"out": str(result.out) if result.out else None, **result.provenance.to_dict()}
        print(json.dumps(summary, indent=2))
        return
    prov = result.provenance
    table = Table(title=f"{prov.kv_dtype} K/V scales ({prov.strategy}, {prov.dataset.num_samples} samples, "
                  f"{prov.dataset.num_tokens} tokens)")
    for name in ("layer", "K amax", "k_scale", "K sat.", "V amax", "v_scale", "V sat."):
        table.add_column(name, justify="right")
    for row in prov.layers:
        table.add_row(
            str(row.layer),
            f"{row.k.amax:.6g}", f"{row.k.scale:.6g}", f"{row.k.saturation:.3%}",
            f"{row.v.amax:.6g}", f"{row.v.scale:.6g}", f"{row.v.saturation:.3%}",
        )
    console = text_console()
    console.print(table)
    if prov.skipped_layers:
        console.print(f"layers without their own KV cache (no scale): {list(prov.skipped_layers)}")
    if result.out is not None:  # plain print: rich would wrap a long path inside the command to copy
        print(f"wrote {result.out} ({prov.format})")
        print(f"next: fp8kv verify {shlex.quote(str(result.out))}")
