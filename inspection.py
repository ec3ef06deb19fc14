"""`fp8kv inspect`: what a checkpoint's KV scales are, where they came from, and what the checks find."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.checkpoint.provenance import LayerRecord, read_provenance
from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.checks import check_readout



def inspect_checkpoint(model_dir: str | Path) -> dict[str, Any]:
    """A JSON-ready report: conventions, kv dtype, per-layer scales (and amax/saturation), warnings."""
    readout = read_kv_scales(resolve_model(str(model_dir)))
    source = readout.source
    provenance = read_provenance(source.path)
    return {
        "path": str(source.path),
        "model_type": source.geometry.model_type,
        "conventions": list(readout.conventions),
        "declared": readout.declared,
        "kv_dtype": readout.kv_dtype,
        "strategy": readout.scales.strategy if readout.scales else None,
        "num_kv_heads": source.geometry.num_kv_heads,
        "kv_layers": list(source.geometry.kv_layers),
        "latent": None if source.geometry.latent is None else asdict(source.geometry.latent),
        "layers": _layer_rows(readout, provenance.layer_map() if provenance else {}),
        "warnings": [finding.message for finding in check_readout(readout, provenance)],
    }


def _layer_rows(readout: ScaleReadout, provenance: dict[int, LayerRecord]) -> list[dict[str, Any]]:
    """The file's scales per layer, with the amax and saturation fp8kv recorded when it wrote them."""
    if readout.scales is None:
        return []
    rows = readout.scales.rows()
    for row in rows:
        if readout.scales.q is not None:
            row["q_scale"] = readout.scales.q_value(row["layer"])
        recorded = provenance.get(row["layer"])
        if recorded is not None:
            row.update(k_amax=recorded.k.amax, v_amax=recorded.v.amax, k_saturation=recorded.k.saturation,
                       v_saturation=recorded.v.saturation)
    return rows
