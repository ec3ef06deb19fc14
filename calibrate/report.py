"""What `fp8kv calibrate` shows when done: a per-layer table or a JSON summary, and the next command."""

from __future__ import annotations

import json

from fp8kv.calibrate.pipeline import CalibrationResult
from fp8kv.checkpoint.locate import verify_command
from fp8kv.console import fmt_number, layer_table, rich_table, text_console
from fp8kv.serving import NOT_STARTED, Serving, serving, serving_heading, serving_lines, traits_of


def show(result: CalibrationResult, json_output: bool = False) -> None:
    """Print the per-layer table (or JSON on stdout) and the next command; warnings go to stderr.

    The data note was announced before the work (`StageProgress.note`); it is in the provenance too.
    """
    err = text_console(stderr=True)
    for line in result.warnings:
        err.print(f"fp8kv: {line}", highlight=False)
    prov = result.provenance
    served: tuple[Serving, ...] = () if result.out is None else serving(
        traits_of(result.out, prov.format, bool(prov.per_head)))
    if json_output:  # stdout is the JSON: an engine that would not start on the output is said on stderr
        for engine in served:
            if engine.outcome == NOT_STARTED:
                err.print(f"fp8kv: {engine.line}", highlight=False)
        summary = {"out": str(result.out) if result.out else None, **result.provenance.to_dict()}
        print(json.dumps(summary, indent=2))
        return
    title = (f"{prov.kv_dtype} K/V scales = amax x {fmt_number(prov.headroom)} / {fmt_number(prov.fp8_max)} "
             f"({prov.strategy}, {prov.dataset.num_samples} samples, {prov.dataset.num_tokens} tokens)")
    table = rich_table(*layer_table(prov.layer_rows()), title=title)
    console = text_console()
    console.print(table)
    if prov.skipped_layers:
        console.print(f"layers without their own KV cache (no scale): {list(prov.skipped_layers)}")
    if result.out is not None:  # plain print: rich would wrap a long path inside the command to copy
        print(f"wrote {result.out} ({prov.format})")
        print(serving_heading(served[0].traits))
        for line in serving_lines(served):
            print(f"  {line}")
        print(f"next: {verify_command(result.out)}")
