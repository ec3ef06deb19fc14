"""What `fp8kv calibrate` shows when done: a per-layer table or a JSON summary, and the next command."""

from __future__ import annotations

import json
from pathlib import Path

from fp8kv.calibrate.pipeline import CalibrationResult
from fp8kv.checkpoint.locate import verify_command
from fp8kv.console import fmt_number, layer_table, rich_table, text_console
from fp8kv.checkpoint.nvfp4 import nvfp4_convention
from fp8kv.kvdtypes import NVFP4_KV_DTYPES
from fp8kv.options import FP8_K_NVFP4_V
from fp8kv.serving import (
    NO_FP8_K_NVFP4_V_RELEASE, NOT_STARTED, Serving, nvfp4_lines, nvfp4_serve_commands, nvfp4_traits_of, serving, serving_heading,
    serving_lines, traits_of,
)


def show(result: CalibrationResult, json_output: bool = False) -> None:
    """Print the per-layer table (or JSON on stdout) and the next command; warnings go to stderr.

    The data note was announced before the work (`StageProgress.note`); it is in the provenance too.
    """
    err = text_console(stderr=True)
    for line in result.warnings:
        err.print(f"fp8kv: {line}", highlight=False)
    prov = result.provenance
    nvfp4 = prov.kv_dtype in NVFP4_KV_DTYPES
    served: tuple[Serving, ...] = () if result.out is None or nvfp4 else serving(
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
        if nvfp4:
            show_nvfp4(str(result.out), prov.kv_dtype or "", prov.format, prov.headroom)
            return
        print(serving_heading(served[0].traits))
        for line in serving_lines(served):
            print(f"  {line}")
        print(f"next: {verify_command(result.out)}")


def show_nvfp4(out: str, kv_dtype: str, convention: str, headroom: float | None) -> None:
    """What each release and GPU generation runs as the NVFP4 global scale of the folder written (for fp8_k_nvfp4_v,
    what each release read runs instead), how to serve it, and the verify that judges it."""
    divisor = nvfp4_convention(convention).divisor
    mixed = kv_dtype == FP8_K_NVFP4_V
    side, what = ("V", "what each release read does with it") if mixed else \
        ("K and V", "what each release runs on each GPU generation")
    print(f"the stored {side} global scale is amax x {headroom:g} / {divisor:g}; {what} (docs/nvfp4.md):")
    for line in nvfp4_lines(divisor, headroom, kv_dtype, nvfp4_traits_of(out)):
        print(f"  {line}")
    if mixed:
        print(f"K is an fp8 e4m3 cache scaled as with --kv-dtype fp8_e4m3. {NO_FP8_K_NVFP4_V_RELEASE}: verify "
              "judges this folder on fp8kv's own arithmetic")
    else:
        print("serve it with:")
        for command in nvfp4_serve_commands(out, kv_dtype):
            print(f"  {command}")
    print(f"next: {verify_command(Path(out))}")
