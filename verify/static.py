"""Static checks: what the checkpoint files say, before any model runs.

Which convention holds the scales, whether every cache-owning layer has a finite, positive K and
V scale of the right shape, whether the config declares the KV-cache scheme engines need to create
the scale parameters, and what would keep a TPU off its fp8 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.interop import inspect_checkpoint
from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.fp8 import FP8_DTYPES
from fp8kv.runtime.attention import fp8_kernel_note
from fp8kv.runtime.device import TPU_HEAD_DIM_MULTIPLE
from fp8kv.verify.verdict import FAIL, INFO, WARN, Reason



@dataclass(frozen=True)
class StaticResult:
    """The scale readout, the findings, and whether the scales can drive an fp8 cache at all."""

    readout: ScaleReadout
    reasons: list[Reason]
    inspect_warnings: list[str]
    runnable: bool

    @property
    def convention(self) -> str | None:
        """The convention(s) holding the scales, e.g. "compressed-tensors"; None when there are none."""
        return ", ".join(self.readout.conventions) or None

    def summary(self) -> dict[str, Any]:
        """JSON-ready: conventions, declarations, missing/unexpected layers, strategy, inspect's warnings."""
        readout = self.readout
        return {
            "conventions": list(readout.conventions),
            "declared": readout.declared,
            "has_kv_cache_scheme": readout.has_kv_cache_scheme,
            "strategy": readout.scales.strategy if readout.scales else None,
            "kv_layers": list(readout.source.geometry.kv_layers),
            "missing_layers": list(readout.missing_layers),
            "unexpected_layers": list(readout.unexpected_layers),
            "inspect_warnings": self.inspect_warnings,
        }


def static_checks(model_dir: str | Path) -> StaticResult:
    """Read the checkpoint's scales (any convention) and check them without running the model."""
    readout = read_kv_scales(model_dir)
    scale_reasons = _scale_reasons(readout)
    reasons = scale_reasons + _declaration_reasons(readout) + _tpu_reasons(readout)
    warnings = inspect_checkpoint(model_dir)["warnings"]
    runnable = not any(r.level == FAIL for r in scale_reasons)
    return StaticResult(readout, reasons, warnings, runnable)


def _scale_reasons(readout: ScaleReadout) -> list[Reason]:
    """Missing, zero, negative or non-finite scales, and per-head scales of the wrong length."""
    path = readout.source.path
    if not readout.conventions:
        return [Reason(FAIL, f"{path}: no KV scales found in any convention; engines use 1.0 for every layer "
                             "(run fp8kv calibrate)")]
    reasons = []
    if readout.missing_layers:
        reasons.append(Reason(FAIL, f"layers {list(readout.missing_layers)} own a KV cache but have no K and V "
                                    "scales; engines silently use 1.0 for them"))
    if readout.scales is None:
        return reasons
    reasons += [Reason(FAIL, line) for line in readout.scales.problems()]
    heads = readout.source.geometry.num_kv_heads
    if readout.scales.strategy == "attn_head":
        sizes = {layer: readout.scales.k[layer].shape[0] for layer in readout.scales.layers}
        wrong = sorted(layer for layer, n in sizes.items() if n != heads)
        if wrong:
            reasons.append(Reason(FAIL, f"layers {wrong}: per-head scales have {sizes[wrong[0]]} values but the "
                                        f"model has {heads} KV heads; expected shape [{heads}, 1, 1]"))
    if readout.unexpected_layers:
        reasons.append(Reason(WARN, f"scales for layers {list(readout.unexpected_layers)}, which own no KV cache; "
                                    "engines may refuse the unexpected tensors"))
    return reasons


def _declaration_reasons(readout: ScaleReadout) -> list[Reason]:
    """Scales whose config does not tell the engine to create the scale parameters."""
    declared, reasons = readout.declared, []
    first = readout.source.geometry.kv_layers[0]
    if "compressed-tensors" in readout.conventions and not readout.has_kv_cache_scheme:
        reasons.append(Reason(FAIL, (
            "config.json has no quantization_config with a kv_cache_scheme: recent vLLM refuses to load this "
            f"checkpoint (\"There is no module or parameter named 'layers.{first}.self_attn.k_scale'\") and "
            "older engines silently ignored the scales; fp8kv convert --to compressed-tensors adds it")))
    if "modelopt" in readout.conventions and not declared["modelopt"]:
        reasons.append(Reason(FAIL, "k_proj.k_scale tensors without kv_cache_quant_algo in hf_quant_config.json: "
                                    "engines do not create the scale parameters and ignore or refuse the scales"))
    if "quark" in readout.conventions and not (declared["quark"] or declared["fp8"]):
        reasons.append(Reason(FAIL, "k_proj.output_scale tensors without a Quark kv_cache_group or fp8 "
                                    "kv_cache_scheme in config.json: engines ignore or refuse the scales"))
    if "vllm-json" in readout.conventions:
        reasons.append(Reason(INFO, "scales in the legacy vLLM JSON file: engines read them only with "
                                    "--quantization-param-path"))
    return reasons


def _tpu_reasons(readout: ScaleReadout) -> list[Reason]:
    """Where vLLM's TPU backend would not run the fp8 Pallas kernel, or pads the cache."""
    g = readout.source.geometry
    reasons = []
    note = fp8_kernel_note(g.num_kv_heads, FP8_DTYPES[readout.kv_dtype])
    if note:
        reasons.append(Reason(WARN, note))
    if g.head_dim % TPU_HEAD_DIM_MULTIPLE:
        padded = -(-g.head_dim // TPU_HEAD_DIM_MULTIPLE) * TPU_HEAD_DIM_MULTIPLE
        reasons.append(Reason(INFO, f"head_dim={g.head_dim} is padded to {padded} in a TPU cache "
                                    f"({padded / g.head_dim:.2g}x the cache memory)"))
    return reasons
