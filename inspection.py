"""`fp8kv inspect`: what a checkpoint's KV scales are, where they came from, and what the checks find.

No torch: verify's report holds `ScaleRow`s, and the card reads that report without it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.checkpoint.nvfp4 import Nvfp4Reading, nvfp4_convention
from fp8kv.checkpoint.provenance import LayerRecord, read_provenance
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checks import check_readout
from fp8kv.console import layer_table, rich_table, text_console
from fp8kv.geometry import LatentCache
from fp8kv.json_fields import to_json_value
from fp8kv.options import FP8_K_NVFP4_V
from fp8kv.serving import nvfp4_lines, nvfp4_traits_of

Scale = float | tuple[float, ...]  # one per tensor, or one per KV head (--per-head)


@dataclass(frozen=True)
class ScaleRow:
    """One layer's K and V scales as the checkpoint holds them."""

    layer: int
    k_scale: Scale
    v_scale: Scale


@dataclass(frozen=True)
class InspectLayer(ScaleRow):
    """A layer of `fp8kv inspect`: the file's scales, its q_scale, and the amax and saturation fp8kv recorded
    when it wrote them (None: not in the file, or not written by fp8kv calibrate)."""

    q_scale: float | None = None
    k_amax: float | None = None
    v_amax: float | None = None
    k_saturation: float | None = None
    v_saturation: float | None = None


@dataclass(frozen=True)
class Nvfp4Meaning:
    """One reading of a checkpoint's NVFP4 global scales: the convention, `stored = amax / divisor`, and what each
    release fp8kv read runs with it per GPU generation (`runs`, one line each)."""

    convention: str
    divisor: float
    producer: str
    runs: tuple[str, ...]


@dataclass(frozen=True)
class InspectReport:
    """What `fp8kv inspect` found: conventions, kv dtype, per-layer scales, and the checks' warnings."""

    path: str
    model_type: str
    conventions: tuple[str, ...]
    declared: dict[str, bool]  # convention -> whether the config files declare it
    kv_dtype: str | None
    strategy: str | None
    num_kv_heads: int
    kv_layers: tuple[int, ...]
    latent: LatentCache | None
    layers: tuple[InspectLayer, ...]
    warnings: tuple[str, ...]
    nvfp4: Nvfp4Reading | None = None
    nvfp4_meanings: tuple[Nvfp4Meaning, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object; a layer leaves out what the checkpoint does not record (q_scale, amax, saturation)."""
        always = {f.name for f in fields(ScaleRow)}
        out = to_json_value(self)
        out["layers"] = [{key: value for key, value in to_json_value(row).items()
                          if key in always or getattr(row, key) is not None} for row in self.layers]
        return out

    def show(self) -> None:
        """Print the report as text tables on stdout."""
        console = text_console()
        console.print(f"[bold]{self.path}[/bold] ({self.model_type})")
        console.print(f"convention: {', '.join(self.conventions) or 'none'}   kv dtype: {self.kv_dtype}   "
                      f"strategy: {self.strategy or '-'}   kv heads: {self.num_kv_heads}")
        if self.latent is not None:
            console.print(f"MLA latent cache: kv_lora_rank {self.latent.kv_lora_rank} + rope key "
                          f"{self.latent.qk_rope_head_dim} values per token, one scale per layer (k_scale; v_scale "
                          "repeats it)")
        if self.layers:
            console.print(rich_table(*layer_table(self.layers)))
        if self.nvfp4 is not None:
            self._show_nvfp4(console)
        for note in self.warnings:
            console.print(f"[yellow]warning:[/yellow] {note}")

    def _show_nvfp4(self, console: Any) -> None:
        reading = self.nvfp4
        assert reading is not None
        side = "V" if reading.kv_dtype == FP8_K_NVFP4_V else "K and V"
        if reading.known is None:
            console.print(f"NVFP4 {side} global scales: {reading.why}; the files do not tell which convention, so "
                          f"every reading follows (fp8kv convert --from names it)", highlight=False)
        else:
            console.print(f"NVFP4 {side} global scales ({reading.why}):", highlight=False)
        for meaning in self.nvfp4_meanings:
            console.print(f"  {meaning.convention}: stored = amax x h / {meaning.divisor:g} ({meaning.producer}; h: "
                          "the headroom); what each release runs:", highlight=False)
            for line in meaning.runs:
                console.print(f"    {line}", highlight=False)


def inspect_checkpoint(model_dir: str | Path) -> InspectReport:
    """The checkpoint's conventions, kv dtype, per-layer scales (and amax/saturation), and warnings."""
    readout = read_kv_scales(resolve_model(str(model_dir)))
    source, scales = readout.source, readout.scales
    provenance = read_provenance(source.path)
    recorded = provenance.layer_map() if provenance else {}
    headroom = provenance.headroom if provenance else None
    return InspectReport(
        path=str(source.path), model_type=source.geometry.model_type, conventions=readout.conventions,
        declared=readout.declared, kv_dtype=readout.kv_dtype, strategy=scales.strategy if scales else None,
        num_kv_heads=source.geometry.num_kv_heads, kv_layers=tuple(source.geometry.kv_layers),
        latent=source.geometry.latent,
        layers=tuple(_layer_row(scales, layer, recorded.get(layer)) for layer in scales.layers) if scales else (),
        warnings=tuple(finding.message for finding in check_readout(readout, provenance)),
        nvfp4=readout.nvfp4,
        nvfp4_meanings=_nvfp4_meanings(readout.nvfp4, headroom, source.path),
    )


def _nvfp4_meanings(reading: Nvfp4Reading | None, headroom: float | None,
                    folder: Path) -> tuple[Nvfp4Meaning, ...]:
    if reading is None:
        return ()
    traits = nvfp4_traits_of(folder)
    rows = [nvfp4_convention(name) for name in reading.conventions]
    return tuple(Nvfp4Meaning(row.name, row.divisor, row.producer,
                              tuple(nvfp4_lines(row.divisor, headroom, reading.kv_dtype, traits))) for row in rows)


def scale_rows(scales: KVScales | None) -> tuple[ScaleRow, ...]:
    """The file's K and V scales, one row per layer; none without scales."""
    return tuple(ScaleRow(layer, *layer_scales(scales, layer)) for layer in scales.layers) if scales else ()


def layer_scales(scales: KVScales, layer: int) -> tuple[Scale, Scale]:
    """`layer`'s K and V scales: a float per tensor, a tuple per head."""
    k, v = scales.values(layer)
    return (k[0] if len(k) == 1 else tuple(k)), (v[0] if len(v) == 1 else tuple(v))


def _layer_row(scales: KVScales, layer: int, recorded: LayerRecord | None) -> InspectLayer:
    k, v = layer_scales(scales, layer)
    if recorded is None:
        return InspectLayer(layer, k, v, scales.q_value(layer))
    return InspectLayer(layer, k, v, scales.q_value(layer), recorded.k.amax, recorded.v.amax,
                        recorded.k.saturation, recorded.v.saturation)
