"""`fp8kv inspect` and `fp8kv convert`: explain a checkpoint's KV scales, or rewrite them in another convention."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from fp8kv import __version__
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, is_fp8kv_output
from fp8kv.checkpoint.conventions import VLLM_JSON_FILE
from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.geometry import read_json
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import FP8_DTYPES
from fp8kv.runtime.attention import fp8_kernel_note

_QK_NORM = re.compile(r"self_attn\.(k_norm|k_layernorm|key_layernorm)\.weight$")
# Conventions whose tools observed k_proj's output: before k_norm and before RoPE.
_PRE_ROPE = ("quark", "kv_scale")


def inspect_checkpoint(model_dir: str | Path) -> dict[str, Any]:
    """A JSON-ready report: conventions, kv dtype, per-layer scales (and amax/saturation), warnings."""
    readout = read_kv_scales(model_dir)
    source = readout.source
    provenance = _provenance(source.path)
    layers = _layer_rows(readout, provenance)
    return {
        "path": str(source.path),
        "model_type": source.geometry.model_type,
        "conventions": list(readout.conventions),
        "declared": readout.declared,
        "kv_dtype": readout.kv_dtype,
        "strategy": readout.scales.strategy if readout.scales else None,
        "num_kv_heads": source.geometry.num_kv_heads,
        "kv_layers": list(source.geometry.kv_layers),
        "layers": layers,
        "warnings": _warnings(readout, layers, provenance is not None),
    }


def convert_checkpoint(
    model_dir: str | Path, out_dir: str | Path, to: str, *, overwrite: bool = False, mode: str = "overlay",
    command: str | None = None,
) -> Path:
    """Read the scales of `model_dir` (any convention) and write them to `out_dir` in convention `to`.

    The output's fp8kv.json is the source's (the scales are the same numbers) with the new format
    and where they came from; the source's verify report and card are not carried over.
    Query scales (q_scale) have a home only in compressed-tensors; other targets leave them out.
    """
    readout = read_kv_scales(model_dir)
    if readout.scales is None:
        raise Fp8kvError(f"{readout.source.path}: holds no KV scales to convert; run fp8kv calibrate first")
    source_record = read_json(readout.source.path / PROVENANCE_FILE) if is_fp8kv_output(readout.source.path) else {}
    record = {**source_record, "tool": "fp8kv", "version": __version__, "command": command, "format": to,
              "converted_from": {"path": str(readout.source.path), "conventions": list(readout.conventions)}}
    record.setdefault("layers", [])
    extra = {PROVENANCE_FILE: (json.dumps(record, indent=2) + "\n").encode()}
    scales = readout.scales if to == "compressed-tensors" else replace(readout.scales, q=None)
    return write_checkpoint(model_dir, out_dir, scales, convention=to, mode=mode, overwrite=overwrite,
                            extra_files=extra)


def engine_flag(out_dir: Path) -> str:
    """The vLLM flags that load a legacy JSON scale file written to `out_dir`."""
    return f"--kv-cache-dtype fp8 --quantization-param-path {out_dir / VLLM_JSON_FILE}"


def _provenance(root: Path) -> dict[int, dict[str, Any]] | None:
    path = root / PROVENANCE_FILE
    if not path.is_file():
        return None
    rows = read_json(path).get("layers")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("layer"), int) for r in rows):
        raise Fp8kvError(f"{path}: 'layers' must be a list of objects with an integer 'layer'")
    return {row["layer"]: row for row in rows}


def _layer_rows(readout: ScaleReadout, provenance: dict[int, dict[str, Any]] | None) -> list[dict[str, Any]]:
    if readout.scales is None:
        return []
    rows = []
    for layer in readout.scales.layers:
        k, v = readout.scales.values(layer)
        row: dict[str, Any] = {"layer": layer, "k_scale": k[0] if len(k) == 1 else k,
                               "v_scale": v[0] if len(v) == 1 else v}
        if readout.scales.q is not None:
            row["q_scale"] = readout.scales.q_value(layer)
        extra = (provenance or {}).get(layer, {})
        for key in ("k_amax", "v_amax", "k_saturation", "v_saturation"):
            if key in extra:
                row[key] = extra[key]
        rows.append(row)
    return rows


def _warnings(readout: ScaleReadout, rows: list[dict[str, Any]], by_fp8kv: bool) -> list[str]:
    geometry = readout.source.geometry
    notes: list[str] = []
    if not readout.conventions:
        notes.append("no KV scales found: engines use 1.0 for every layer (uncalibrated)")
    if readout.scales is not None:
        notes += readout.scales.problems()
        values = [x for layer in readout.scales.layers for part in readout.scales.values(layer) for x in part]
        if values and all(x == 1.0 for x in values):
            notes.append("every scale is 1.0: the checkpoint is likely uncalibrated")
    if readout.missing_layers:
        notes.append(f"layers {list(readout.missing_layers)} own a KV cache but have no K and V scales; "
                     "engines use 1.0 for them")
    if readout.unexpected_layers:
        notes.append(f"scales for layers {list(readout.unexpected_layers)}, which own no KV cache")
    pre_rope = [c for c in readout.conventions if c in _PRE_ROPE]
    if pre_rope and not by_fp8kv and any(_QK_NORM.search(t) for t in readout.source.weight_map):
        notes.append(f"{pre_rope[0]} scales observe k_proj's output, but this model has a k norm: the statistics "
                     "were taken before k_norm and RoPE, not where the cache stores K; recalibrate")
    notes += _fnuz_warning(readout, rows)
    kernel_note = fp8_kernel_note(geometry.num_kv_heads, FP8_DTYPES[readout.kv_dtype])
    if kernel_note:
        notes.append(kernel_note)
    notes += _undeclared(readout)
    return notes


def _fnuz_warning(readout: ScaleReadout, rows: list[dict[str, Any]]) -> list[str]:
    """Scales twice amax/MAX look pre-doubled for e4m3fnuz; engines double them again themselves."""
    if readout.scales is None:
        return []
    fp8_max = readout.scales.fp8_max
    ratios = []
    for row in rows:
        for kind in ("k", "v"):
            amax, scale = row.get(f"{kind}_amax"), row[f"{kind}_scale"]
            if isinstance(amax, (int, float)) and isinstance(scale, float) and amax > 0 and math.isfinite(amax):
                ratios.append(scale / (amax / fp8_max))
    if ratios and all(1.9 <= r <= 2.1 for r in ratios):
        return ["scales are about twice amax/MAX: they look doubled for e4m3fnuz; store OCP e4m3 scales, "
                "AMD engines double them at load time"]
    return []


def _undeclared(readout: ScaleReadout) -> list[str]:
    notes = []
    declared = readout.declared
    if "compressed-tensors" in readout.conventions and not declared["compressed-tensors"]:
        notes.append("self_attn.k_scale tensors without quantization_config.kv_cache_scheme in config.json: "
                     "vLLM refuses to load them; fp8kv convert --to compressed-tensors adds it")
    if "modelopt" in readout.conventions and not declared["modelopt"]:
        notes.append("k_proj.k_scale tensors without kv_cache_quant_algo in hf_quant_config.json")
    if "quark" in readout.conventions and not (declared["quark"] or declared["fp8"]):
        notes.append("k_proj.output_scale tensors without a Quark kv_cache_group or fp8 kv_cache_scheme in config.json")
    if "vllm-json" in readout.conventions:
        notes.append("the legacy vLLM JSON file stores one scale per layer for K and V together; load it with "
                     "--quantization-param-path")
    return notes


def print_report(report: dict[str, Any]) -> None:
    """Render an inspect report as text tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{report['path']}[/bold] ({report['model_type']})")
    console.print(f"convention: {', '.join(report['conventions']) or 'none'}   kv dtype: {report['kv_dtype']}   "
                  f"strategy: {report['strategy'] or '-'}   kv heads: {report['num_kv_heads']}")
    if report["layers"]:
        table = Table()
        keys = [k for k in ("k_scale", "v_scale", "q_scale", "k_amax", "v_amax", "k_saturation", "v_saturation")
                if any(k in row for row in report["layers"])]
        for key in ("layer", *keys):
            table.add_column(key, justify="right")
        for row in report["layers"]:
            table.add_row(str(row["layer"]), *(_cell(row.get(k)) for k in keys))
        console.print(table)
    for note in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {note}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(f"{x:.6g}" for x in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)
