"""`fp8kv convert`: rewrite a checkpoint's KV scales in another convention."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fp8kv import __version__
from fp8kv.checkpoint.conventions import VLLM_JSON_FILE, vllm_format_gaps, vllm_json_readers
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.nvfp4 import check_nvfp4_target, converted, nvfp4_convention
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.provenance import ConvertedFrom, Provenance, read_provenance
from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.errors import Fp8kvError
from fp8kv.options import DEFAULT_MODE


def convert_checkpoint(
    model_dir: str | Path, out_dir: str | Path, convention: str, *, overwrite: bool = False, mode: str = DEFAULT_MODE,
    command: str | None = None, source_convention: str | None = None,
) -> Path:
    """Read the scales of `model_dir` (any convention) and write them to `out_dir` in `convention`.

    The output's fp8kv.json is the source's (the scales are the same numbers) with the new format
    and where they came from; the source's verify report and card are not carried over.
    Query scales (q_scale) have a home only in compressed-tensors; other targets leave them out. NVFP4 global
    scales are multiplied by the factor between the source's convention and `convention`; `source_convention`
    names the source's where its files do not tell.
    """
    readout = read_kv_scales(model_dir)
    if readout.scales is None:
        raise Fp8kvError(f"{readout.source.path}: holds no KV scales to convert; run fp8kv calibrate first")
    scales, source_name = _nvfp4_converted(readout, readout.scales, source_convention, convention)
    origin = ConvertedFrom(str(readout.source.path), tuple(readout.conventions))
    source_record = read_provenance(readout.source.path)
    if source_record is None:  # scales fp8kv did not calibrate: nothing about their making is known
        record = Provenance(version=__version__, command=command, format=convention, converted_from=origin)
    else:
        record = source_record.converted(__version__, command, convention, origin)
        if source_name is not None:
            record = _rescaled(record, scales, nvfp4_convention(convention).divisor)
    scales = scales if convention == "compressed-tensors" else replace(scales, q=None)
    return write_checkpoint(model_dir, out_dir, scales, convention=convention, mode=mode, overwrite=overwrite,
                            record=record)


def format_gap(out_dir: Path, convention: str) -> str | None:
    """One line when vLLM (0.32) refuses `convention`'s scale names for the model written to `out_dir`."""
    source = SourceCheckpoint.open(out_dir)
    return vllm_format_gaps((convention,), list(source.weight_map), source.geometry.model_type,
                            source.geometry.kv_layers[0])


def serve_hint(out_dir: Path) -> str:
    """Which engine reads the legacy JSON scale file written to `out_dir`, and how."""
    return f"{VLLM_JSON_FILE}: {vllm_json_readers(out_dir / VLLM_JSON_FILE)}"


def _nvfp4_converted(readout: ScaleReadout, scales: KVScales, source_convention: str | None,
                     target: str) -> tuple[KVScales, str | None]:
    """The scales as `target` stores them, and the NVFP4 convention they came from (None: fp8 scales)."""
    path, reading = readout.source.path, readout.nvfp4
    if reading is None:
        if source_convention is not None:
            raise Fp8kvError(f"{path}: holds {readout.kv_dtype} scales, not NVFP4 ones; drop --from")
        return scales, None
    if source_convention is not None and source_convention not in reading.conventions:
        raise Fp8kvError(f"{path}: --from {source_convention} contradicts its files ({reading.why}: "
                         f"{' or '.join(reading.conventions)})")
    source = source_convention or (reading.known.name if reading.known else None)
    if source is None:
        choices = " or ".join(f"--from {name}" for name in reading.conventions)
        raise Fp8kvError(f"{path}: {reading.why}, so its NVFP4 scales may be "
                         f"{' or '.join(f'amax / {nvfp4_convention(n).divisor:g}' for n in reading.conventions)}; "
                         f"pass {choices}")
    check_nvfp4_target(readout.kv_dtype, target, scales.strategy)
    return converted(scales, source, target), source


def _rescaled(record: Provenance, scales: KVScales, divisor: float) -> Provenance:
    """The source's record with the converted scales and their divisor, so the record still matches the file."""
    layers = tuple(replace(row, k=replace(row.k, scale=scales.k[row.layer][0]),
                           v=replace(row.v, scale=scales.v[row.layer][0]))
                   for row in record.layers if row.layer in scales.k)
    return replace(record, layers=layers, fp8_max=divisor)
