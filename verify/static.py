"""verify's static stage: the checks' findings on what the checkpoint files say, before any model runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.checks import Finding, check_readout, scales_usable, tpu_layout_findings
from fp8kv.verify.results import StaticSummary


@dataclass(frozen=True)
class StaticResult:
    """The scale readout, the findings, and whether the scales can drive an fp8 cache at all."""

    readout: ScaleReadout
    reasons: list[Finding]
    runnable: bool
    headroom: float | None = None  # the margin the scales were calibrated with, where fp8kv made them

    @property
    def convention(self) -> str | None:
        """The convention(s) holding the scales, e.g. "compressed-tensors"; None when there are none."""
        return ", ".join(self.readout.conventions) or None

    def summary(self) -> StaticSummary:
        """The report's static section: conventions, declarations, strategy, missing/unexpected layers."""
        readout = self.readout
        return StaticSummary(
            conventions=readout.conventions, declared=readout.declared,
            has_kv_cache_scheme=readout.has_kv_cache_scheme,
            strategy=readout.scales.strategy if readout.scales else None,
            kv_layers=readout.source.geometry.kv_layers, missing_layers=readout.missing_layers,
            unexpected_layers=readout.unexpected_layers,
        )


def static_checks(model_dir: str | Path, torch_xla_kernel: bool = True) -> StaticResult:
    """Read the checkpoint's scales (any convention) and check them without running the model; `torch_xla_kernel`:
    whether vLLM's torch_xla TPU backend is among the engines judged (its kernel's head rule applies then)."""
    readout = read_kv_scales(model_dir)
    provenance = read_provenance(readout.source.path)
    # no TPU engine has an NVFP4 cache: its fp8 layout rules say nothing about one
    fp8 = readout.nvfp4 is None
    findings = check_readout(readout, provenance, torch_xla_kernel and fp8) + (tpu_layout_findings(readout) if fp8 else [])
    return StaticResult(readout, findings, scales_usable(readout), provenance.headroom if provenance else None)
