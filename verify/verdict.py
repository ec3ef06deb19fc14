"""Thresholds (configs/verify.toml, a file, or flags) and the PASS / WARN / FAIL verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from fp8kv.checks import FAIL, WARN, Finding
from fp8kv.errors import ExitCode, Fp8kvError
from fp8kv.options import VERDICTS, Verdict
from fp8kv.verify.results import Accuracy, LayerCheck

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXIT_CODES = {name: int(ExitCode[name]) for name in VERDICTS}
# Below this many nats the calibrated and unit-scale KLs differ by fp8 rounding noise alone: on the
# bundled model, scales that differ only in their margin moved mean KL by up to 8e-5 either way, and
# random-weight models (KL near 1e-6) flip the ratio from one held-out draw to the next.
UNIT_KL_NOISE = 1e-4
DEFAULTS_FILE = "verify.toml"
# Which TOML table each threshold lives in.
_SECTIONS = {"kl_mean": "fail", "saturation": "warn", "unit_kl_ratio": "warn", "unit_ppl_ratio": "warn"}


@dataclass(frozen=True)
class Thresholds:
    """Bounds of the verdict; the defaults and their meaning live in configs/verify.toml."""

    kl_mean: float
    saturation: float
    unit_kl_ratio: float
    unit_ppl_ratio: float


def load_thresholds(path: Path | None = None, **overrides: float | None) -> Thresholds:
    """The packaged defaults, updated by the TOML file at `path`, then by non-None `overrides`."""
    text = resources.files("fp8kv.configs").joinpath(DEFAULTS_FILE).read_text(encoding="utf-8")
    values = _flatten(tomllib.loads(text), DEFAULTS_FILE)
    if path is not None:
        try:
            values.update(_flatten(tomllib.loads(Path(path).read_text(encoding="utf-8")), str(path)))
        except tomllib.TOMLDecodeError as exc:
            raise Fp8kvError(f"{path}: not valid TOML ({exc})") from None
    thresholds = Thresholds(**values)
    unknown = sorted(set(overrides) - {f.name for f in fields(Thresholds)})
    if unknown:
        raise Fp8kvError(f"unknown thresholds {unknown}")
    return replace(thresholds, **{k: check_bound(v, f"{k} = ") for k, v in overrides.items() if v is not None})


def check_bound(value: object, where: str = "") -> float:
    """A threshold is a number >= 0: NaN compares false with every result, so it would let anything pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise Fp8kvError(f"{where}{value!r} must be a number >= 0")
    return float(value)


def _flatten(data: dict[str, Any], source: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise Fp8kvError(f"{source}: {section!r} must be a table, [fail] or [warn]")
        for key, value in table.items():
            if _SECTIONS.get(key) != section:
                raise Fp8kvError(f"{source}: unknown threshold [{section}] {key}; known: "
                                 + ", ".join(f"[{s}] {k}" for k, s in _SECTIONS.items()))
            values[key] = check_bound(value, f"{source}: [{section}] {key} = ")
    return values


def verdict(reasons: list[Finding]) -> Verdict:
    """FAIL if any reason fails, else WARN if any warns, else PASS."""
    levels = {r.level for r in reasons}
    return "FAIL" if FAIL in levels else "WARN" if WARN in levels else "PASS"


def heldout_reasons(layers: list[LayerCheck], thresholds: Thresholds, fp8_max: float,
                    with_fix: bool = True, headroom: float | None = None) -> list[Finding]:
    """Saturation above its bound, one short line per layer, then (`with_fix`) the one --headroom that fixes
    every layer at once; `fp8_max` is the dtype's largest value, `headroom` the margin the scales were made with."""
    reasons, worst = [], 0.0
    for row in layers:
        for kind in ("k", "v"):
            share, ratio = getattr(row, f"{kind}_saturation"), getattr(row, f"{kind}_max_ratio")
            if share > thresholds.saturation:
                worst = max(worst, ratio)
                reasons.append(Finding(WARN, f"layer {row.layer}: {share:.3%} of {kind.upper()} values saturate at "
                                            f"±{fp8_max:g} (WARN above {thresholds.saturation:.3%}); the largest "
                                            f"|x|/scale is {ratio:.4g}, {ratio / fp8_max - 1:.1%} past the calibrated "
                                            "range"))
    if reasons and with_fix:
        reasons.append(Finding(WARN, f"engines that clamp store those values as ±{fp8_max:g}. "
                                     + headroom_fix(worst, fp8_max, headroom, every_layer=len(reasons) > 1)))
    return reasons


# A margin above this many times the calibrated amax is not a margin: scales that need it were made wrong.
MAX_ADVISED_HEADROOM = 16.0


def headroom_fix(ratio: float, fp8_max: float, headroom: float | None = None, every_layer: bool = False) -> str:
    """The advice for scales that `ratio` (the worst layer's largest |x|/scale) overflows: the `--headroom` value to
    pass to `fp8kv calibrate` on the same calibration text, the margin they were made with (`headroom`, None when
    fp8kv did not make them) times the factor they fall short by, so that following it literally fits `ratio`.
    Past `MAX_ADVISED_HEADROOM` times the scales are not short of a margin but wrong, and the advice says so."""
    factor = ratio / fp8_max
    if not factor <= MAX_ADVISED_HEADROOM:
        return (f"Fix: these scales are {factor:.3g}x too small for this text, far beyond what a margin "
                "is for: recalibrate (fp8kv calibrate) on text like this, or check how the scales were made.")
    who = " for every layer" if every_layer else ""
    cheap = "e4m3's relative precision is the same across its range, so this costs almost nothing"
    if headroom is None:
        needed = _hundredths_up(factor)
        return (f"Fix{who}: every scale x{needed:.2f} or more ({cheap}); these scales were not made by fp8kv, so "
                "recalibrate with fp8kv calibrate on text like this, or multiply them.")
    needed = max(_hundredths_up(headroom * factor), round(headroom + 0.01, 2))
    return (f"Fix{who}: recalibrate on the same text with --headroom {needed:.2f} (the scales were made with "
            f"{headroom:g}; {needed:.2f} makes every scale x{needed / headroom:.3f}; {cheap}), or on text like this.")


def _hundredths_up(value: float) -> float:
    """`value` rounded up to two decimals, never below it (a float's own rounding could put ceil's result under)."""
    up = math.ceil(value * 100) / 100
    return up if up >= value else up + 0.01


def accuracy_reasons(accuracy: Accuracy, nan_with_clamp: dict[int, int], thresholds: Thresholds) -> list[Finding]:
    """NaN with clamping and the KL bound (FAIL); calibrated scales worse than unit scales (WARN)."""
    reasons = []
    if nan_with_clamp:
        named = ", ".join(f"layer {layer} ({n})" for layer, n in sorted(nan_with_clamp.items()))
        reasons.append(Finding(FAIL, f"NaN/inf values in the clamped fp8 cache: {named}"))
    kl = accuracy.kl_mean
    if not _finite(kl) or not _finite(accuracy.ppl_fp8):
        reasons.append(Finding(FAIL, "the fp8 cache with these scales gives NaN/inf logits"))
        return reasons
    if kl > thresholds.kl_mean:
        reasons.append(Finding(FAIL, f"mean KL to the bf16 cache {kl:.4g} nats exceeds the bound {thresholds.kl_mean:g}"))
    unit_kl, unit_ppl = accuracy.kl_mean_unit, accuracy.ppl_fp8_unit
    if _finite(unit_kl) and kl > unit_kl * thresholds.unit_kl_ratio and kl - unit_kl > UNIT_KL_NOISE:
        reasons.append(Finding(WARN, f"calibrated scales do worse than unit scales: mean KL {kl:.4g} vs {unit_kl:.4g} "
                                    f"(ratio bound {thresholds.unit_kl_ratio:g})"))
    if _finite(unit_ppl) and accuracy.ppl_fp8 > unit_ppl * thresholds.unit_ppl_ratio:
        reasons.append(Finding(WARN, f"calibrated scales do worse than unit scales: perplexity "
                                    f"{accuracy.ppl_fp8:.4f} vs {unit_ppl:.4f} "
                                    f"(ratio bound {thresholds.unit_ppl_ratio:g})"))
    return reasons


def unit_scale_note(accuracy: Accuracy, unit_ppl_ratio: float) -> str | None:
    """When calibrated and unit-scale perplexities differ by less than the band the verdict treats as equal,
    one line saying so (a reader otherwise takes 37.81 against 37.80 for a finding); else None."""
    ppl, unit = accuracy.ppl_fp8, accuracy.ppl_fp8_unit
    if not (_finite(ppl) and _finite(unit)) or not unit > 0 or ppl > unit * unit_ppl_ratio:
        return None
    return (f"perplexity with these scales and with unit scales differ by {abs(ppl / unit - 1):.2%}, inside the "
            f"{unit_ppl_ratio - 1:.0%} the verdict treats as noise (--unit-ppl-ratio {unit_ppl_ratio:g}): on this "
            "text the two are equally good, and the calibrated ones keep values inside the fp8 range")


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
