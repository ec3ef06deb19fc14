"""The checks: what a checkpoint's scale readout gets wrong or should warn about, before any model runs.

Each fact is graded once, here; `fp8kv inspect` and `fp8kv verify` only display the findings.
FAIL and WARN decide verify's verdict; INFO never changes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp8kv.checkpoint.conventions import (
    COMPRESSION_CONFIG, HF_QUANT_CONFIG, QUANTIZATION_CONFIG, VLLM_JSON_FILE, attention_modules, parse_scale_name,
    scale_convention, scale_names, vllm_format_gaps, vllm_json_readers, vllm_loading_gap,
)
from fp8kv.checkpoint.provenance import Provenance
from fp8kv.geometry import read_json
from fp8kv.kvdtypes import SCALE_BOUND

from fp8kv.runtime.kernel_rule import TPU_HEAD_DIM_MULTIPLE, fp8_kernel_note

if TYPE_CHECKING:  # a Finding (what reports hold) needs no torch
    from fp8kv.checkpoint.reader import ScaleReadout

FAIL, WARN, INFO = "FAIL", "WARN", "INFO"
_QK_NORM = re.compile(r"self_attn\.(k_norm|k_layernorm|key_layernorm)\.weight$")


@dataclass(frozen=True)
class Finding:
    """One finding: `level` is FAIL, WARN or INFO (INFO never changes the verdict); `engines`: the engine releases
    it is about alone (none: it is about the scales or the checkpoint, whatever serves them)."""

    level: str
    message: str
    engines: tuple[str, ...] = ()


def check_readout(readout: ScaleReadout, provenance: Provenance | None = None,
                  torch_xla_kernel: bool = True) -> list[Finding]:
    """Every finding about the scales a checkpoint holds and how its config declares them.

    `provenance` is the folder's fp8kv.json (None when fp8kv did not write it); its amax values reveal
    scales doubled for e4m3fnuz. `torch_xla_kernel`: whether the engines judged include vLLM's torch_xla TPU
    backend, whose Pallas kernel cannot tile every KV-head count (tpu-inference's kernel pads the heads).
    """
    return (_scale_findings(readout) + _advice(readout, provenance) + _declaration_findings(readout)
            + _engine_name_findings(readout) + _format_gap_findings(readout)
            + (_kernel_findings(readout) if torch_xla_kernel else []) + _latent_loader_findings(readout, provenance))


def tpu_layout_findings(readout: ScaleReadout) -> list[Finding]:
    """How a TPU cache would pad this model's head_dim (a cost, never a fault); not the MLA latent cache."""
    g = readout.source.geometry
    if g.latent is not None or not g.head_dim % TPU_HEAD_DIM_MULTIPLE:
        return []
    padded = -(-g.head_dim // TPU_HEAD_DIM_MULTIPLE) * TPU_HEAD_DIM_MULTIPLE
    return [Finding(INFO, f"head_dim={g.head_dim} is padded to {padded} in a TPU cache "
                          f"({padded / g.head_dim:.2g}x the cache memory)")]


def scales_usable(readout: ScaleReadout) -> bool:
    """Whether the scales can drive an fp8 cache at all: present, complete, positive, finite, right shape."""
    return not any(f.level == FAIL for f in _scale_findings(readout))


def _scale_findings(readout: ScaleReadout) -> list[Finding]:
    """Missing, zero, negative or non-finite scales, and per-head scales of the wrong length."""
    if not readout.conventions:
        return [Finding(FAIL, "no KV scales found: engines use 1.0 for every layer (uncalibrated; "
                              "run fp8kv calibrate)")]
    findings = []
    if readout.missing_layers:
        findings.append(Finding(FAIL, f"layers {list(readout.missing_layers)} own a KV cache but have no K and V "
                                      "scales; engines silently use 1.0 for them"))
    if readout.scales is None:
        return findings
    findings += [Finding(FAIL, line) for line in readout.scales.problems()]
    heads = readout.source.geometry.num_kv_heads
    if readout.scales.strategy == "attn_head":
        sizes = {layer: len(readout.scales.k[layer]) for layer in readout.scales.layers}
        wrong = sorted(layer for layer, n in sizes.items() if n != heads)
        if wrong:
            findings.append(Finding(FAIL, f"layers {wrong}: per-head scales have {sizes[wrong[0]]} values but the "
                                          f"model has {heads} KV heads; expected shape [{heads}, 1, 1]"))
    if readout.unexpected_layers:
        findings.append(Finding(WARN, f"scales for layers {list(readout.unexpected_layers)}, which own no KV "
                                      "cache; engines may refuse the unexpected tensors"))
    return findings


def _advice(readout: ScaleReadout, provenance: Provenance | None) -> list[Finding]:
    """Scales that load but were likely made wrong: all 1.0, observed before k_norm, doubled for fnuz."""
    findings = []
    scales = readout.scales
    if scales is not None:
        values = [x for layer in scales.layers for part in scales.values(layer) for x in part]
        if values and all(x == 1.0 for x in values):
            findings.append(Finding(INFO, "every scale is 1.0: the checkpoint is likely uncalibrated"))
    pre_rope = [c for c in readout.conventions if scale_convention(c).pre_rope]
    if pre_rope and provenance is None and any(_QK_NORM.search(t) for t in readout.source.weight_map):
        findings.append(Finding(INFO, f"{pre_rope[0]} scales observe k_proj's output, but this model has a k norm: "
                                      "the statistics were taken before k_norm and RoPE, not where the cache "
                                      "stores K; recalibrate"))
    changed = _changed_since_calibration(readout, provenance)
    if changed:
        findings.append(Finding(WARN, f"the scale file differs from what fp8kv calibrate recorded in fp8kv.json "
                                      f"({changed[0]}{' and more' if len(changed) > 1 else ''}): it was changed "
                                      "after calibration, so fp8kv.json's amax and saturation describe other "
                                      "scales; recalibrate, or verify these as they are"))
    if scales is not None and provenance is not None and _look_doubled(readout, provenance):
        findings.append(Finding(INFO, "scales are about twice amax/MAX: they look doubled for e4m3fnuz; store OCP "
                                      "e4m3 scales, AMD engines double them at load time"))
    return findings


def _changed_since_calibration(readout: ScaleReadout, provenance: Provenance | None) -> list[str]:
    """Each scale whose float32 value is not the one fp8kv calibrate recorded, as 'layer L k_scale X, recorded Y'."""
    scales = readout.scales
    if scales is None or provenance is None:
        return []
    held = {layer: scales.values(layer) for layer in scales.layers}
    return [f"layer {layer} {name} {_shown(now)}, recorded {_shown(wrote)}"
            for layer, name, now, wrote in provenance.changed_scales(held)]


def _shown(values: tuple[float, ...]) -> str:
    return f"{values[0]:.4g}" if len(values) == 1 else "[" + ", ".join(f"{x:.4g}" for x in values) + "]"


def _look_doubled(readout: ScaleReadout, provenance: Provenance) -> bool:
    """Scales twice amax/MAX look pre-doubled for e4m3fnuz; engines double them again themselves."""
    scales = readout.scales
    recorded, ratios = provenance.layer_map(), []
    for layer in scales.layers:
        if layer not in recorded:
            continue
        for cache, values in zip((recorded[layer].k, recorded[layer].v), scales.values(layer)):
            amax = cache.amax
            if len(values) == 1 and amax > 0 and math.isfinite(amax):
                ratios.append(values[0] / (amax / scales.fp8_max))
    return bool(ratios) and all(1.9 <= r <= 2.1 for r in ratios)


def _declaration_findings(readout: ScaleReadout) -> list[Finding]:
    """Scales whose config does not tell the engine to create the scale parameters."""
    declared, findings = readout.declared, []
    first = readout.source.geometry.kv_layers[0]
    if "compressed-tensors" in readout.conventions and not readout.has_kv_cache_scheme:
        findings.append(Finding(FAIL, (
            f"config.json has no {QUANTIZATION_CONFIG} or {COMPRESSION_CONFIG} with a kv_cache_scheme: recent "
            "vLLM refuses to load this checkpoint "
            f"(\"There is no module or parameter named 'layers.{first}.self_attn.k_scale'\") and "
            "older engines silently ignored the scales; fp8kv convert --to compressed-tensors adds it")))
    if "modelopt" in readout.conventions and not declared["modelopt"]:
        findings.append(Finding(FAIL, "k_proj.k_scale tensors without kv_cache_quant_algo in hf_quant_config.json: "
                                      "engines do not create the scale parameters and ignore or refuse the scales"))
    if "quark" in readout.conventions and not (declared["quark"] or declared["fp8"]):
        findings.append(Finding(FAIL, "k_proj.output_scale tensors without a Quark kv_cache_group or fp8 "
                                      "kv_cache_scheme in config.json: engines ignore or refuse the scales"))
    hf_quant = read_json(readout.source.path / HF_QUANT_CONFIG) if HF_QUANT_CONFIG in readout.source.files else None
    for convention in ("modelopt", "quark"):
        gap = convention in readout.conventions and vllm_loading_gap(convention, readout.source.config, hf_quant)
        if gap:
            findings.append(Finding(WARN, f"{gap}; fp8kv convert --to {convention} writes the form vLLM loads"))
    if "vllm-json" in readout.conventions:
        findings.append(Finding(INFO, f"scales in the legacy vLLM JSON file: {vllm_json_readers(VLLM_JSON_FILE)}"))
    return findings


def _format_gap_findings(readout: ScaleReadout) -> list[Finding]:
    """ModelOpt or Quark scales on an architecture whose vLLM loader refuses that format's names."""
    source = readout.source
    gap = vllm_format_gaps(readout.conventions, list(source.weight_map), source.geometry.model_type,
                           source.geometry.kv_layers[0])
    return [Finding(WARN, gap)] if gap else []


def _engine_name_findings(readout: ScaleReadout) -> list[Finding]:
    """compressed-tensors K/V scales under a name vLLM's model file for this architecture does not load."""
    source = readout.source
    if "compressed-tensors" not in readout.conventions:
        return []
    kv = (("k", "compressed-tensors"), ("v", "compressed-tensors"))
    written = {name: found[:2] for name in source.weight_map  # name -> (layer, "k"|"v")
               if (found := parse_scale_name(name)) is not None and found[1:] in kv}
    model_type = source.geometry.model_type
    modules = attention_modules(list(source.weight_map), tuple(sorted({layer for layer, _ in written.values()})))
    loaded = {name for module in modules.values() for name in scale_names("compressed-tensors", module, model_type)}
    misplaced = sorted(name for name in written if name not in loaded)
    if not misplaced:
        return []
    layer, kind = written[misplaced[0]]
    wanted = scale_names("compressed-tensors", modules[layer], model_type)[kind == "v"]
    more = f" (and {len(misplaced) - 1} more)" if len(misplaced) > 1 else ""
    return [Finding(WARN, f"{misplaced[0]}{more}: vLLM loads {model_type} scales as {wanted} and leaves these at "
                          "1.0 or refuses the checkpoint; fp8kv convert --to compressed-tensors renames them")]


def _kernel_findings(readout: ScaleReadout) -> list[Finding]:
    """Where vLLM's TPU backend would not run the fp8 Pallas kernel (its K/V head layout; MLA has none)."""
    if readout.source.geometry.latent is not None:
        return []
    note = fp8_kernel_note(readout.source.geometry.num_kv_heads)
    return [Finding(WARN, note)] if note else []


def _latent_loader_findings(readout: ScaleReadout, provenance: Provenance | None) -> list[Finding]:
    """vLLM runs an MLA latent cache at scale 1.0 (its loader places no checkpoint k_scale there; see
    `checkpoint/latent.py`): harmless while the calibrated latent fits fp8's range at 1.0."""
    if readout.source.geometry.latent is None:
        return []
    note = ("MLA: vLLM's DeepSeek loader does not place a static k_scale on its latent-cache layers and "
            "runs them at scale 1.0 (verify judges the written scales)")
    fp8_max = SCALE_BOUND[readout.kv_dtype]
    amax = max((row.k.amax for row in provenance.layers), default=0.0) if provenance else 0.0
    if amax > fp8_max:
        return [Finding(WARN, f"{note}; at 1.0 the calibrated latent amax {amax:g} exceeds {fp8_max:g}, so "
                              "vLLM would clip it")]
    return [Finding(INFO, note + (f"; the calibrated latent amax {amax:g} fits at 1.0" if provenance else ""))]
