"""Thresholds (configs/verify.toml, a file, or flags) and the PASS / WARN / FAIL verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from fp8kv.checks import FAIL, WARN, Finding
from fp8kv.errors import ExitCode, Fp8kvError
from fp8kv.options import VERDICTS, Verdict
from fp8kv.verify.results import Accuracy, EngineResult, LayerCheck, PairedDifference

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXIT_CODES = {name: int(ExitCode[name]) for name in VERDICTS}
# Below this many nats the calibrated and unit-scale KLs differ by fp8 rounding noise alone: on the
# bundled model, scales that differ only in their margin moved mean KL by up to 8e-5 either way, and
# random-weight models (KL near 1e-6) flip the ratio from one held-out draw to the next.
UNIT_KL_NOISE = 1e-4
# Below this many held-out sequences a bootstrap over sequences has too few to draw from to be trusted (a
# random-weight MoE on 4 sequences put 6 top-1 flips in 192 tokens outside its interval), so unit scales are
# not compared.
MIN_PAIRED_SEQUENCES = 8
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


def clamped_nan_reasons(nan_with_clamp: dict[int, int]) -> list[Finding]:
    """A FAIL when the clamped fp8 cache stored NaN/inf values: the model's own K/V went non-finite, which no
    scale and no engine's write fixes."""
    if not nan_with_clamp:
        return []
    named = ", ".join(f"layer {layer} ({n})" for layer, n in sorted(nan_with_clamp.items()))
    return [Finding(FAIL, f"NaN/inf values in the clamped fp8 cache: {named}")]


def engine_accuracy_reasons(engines: Sequence[EngineResult], thresholds: Thresholds) -> list[Finding]:
    """`accuracy_reasons` of each released engine judged that runs these scales, on that engine's own runs; a
    finding several engines share names them all once. Engines that lost logits fail on that alone
    (`verify.engines`); one that runs at scale 1.0 says so in its own INFO line."""
    named: dict[tuple[str, str], list[str]] = {}
    for engine in engines:
        if engine.accuracy is None or engine.unread or not engine.known_by or engine.nan_rows:
            continue
        for reason in accuracy_reasons(engine.accuracy, {}, thresholds):
            named.setdefault((reason.level, reason.message), []).append(engine.engine)
    return [Finding(level, f"{_engines(names)}: {message}") for (level, message), names in named.items()]


def _engines(names: list[str]) -> str:
    return f"engine {names[0]}" if len(names) == 1 else "engines " + ", ".join(names)


def accuracy_reasons(accuracy: Accuracy, nan_with_clamp: dict[int, int], thresholds: Thresholds) -> list[Finding]:
    """NaN with clamping and the KL bound (FAIL); calibrated scales worse than unit scales (WARN)."""
    reasons = clamped_nan_reasons(nan_with_clamp)
    kl = accuracy.kl_mean
    if not _finite(kl) or not _finite(accuracy.ppl_fp8):
        reasons.append(Finding(FAIL, "the fp8 cache with these scales gives NaN/inf logits"))
        return reasons
    if kl > thresholds.kl_mean:
        reasons.append(Finding(FAIL, f"mean KL to the bf16 cache {kl:.4g} nats exceeds the bound {thresholds.kl_mean:g}"))
    return reasons + unit_scale_reasons(accuracy, thresholds)


_MEASURES = {"kl_mean": "mean KL", "top1_agreement": "top-1 agreement", "nll": "perplexity"}


def unit_scale_reasons(accuracy: Accuracy, thresholds: Thresholds) -> list[Finding]:
    """These scales against unit scales, each measure paired over the held-out sequences: a WARN only where the
    95 % interval puts these scales on the worse side (and, for KL, by more than `unit_kl_ratio` and
    `UNIT_KL_NOISE`: fp8 rounding alone moves KL that much, the same way on every sequence). KL and top-1
    lead: perplexity of a few sequences moves with the text by more than the effect, so it WARNs only past
    `unit_ppl_ratio` and when neither KL nor top-1 says these scales are better."""
    by = {d.measure: d for d in accuracy.versus_unit}
    if any(d.sequences < MIN_PAIRED_SEQUENCES for d in by.values()):
        return []
    leading = [by[m] for m in ("kl_mean", "top1_agreement") if m in by]
    worse = [d for d in leading if d.says_worse()]
    kl = by.get("kl_mean")
    if kl is not None and kl in worse and not (kl.ours > kl.theirs * thresholds.unit_kl_ratio
                                               and kl.difference > UNIT_KL_NOISE):
        worse.remove(kl)  # consistent over sequences, but smaller than the effect the thresholds warn about
    ppl = by.get("nll")
    if (ppl is not None and ppl.says_worse() and not any(d.says_better() for d in leading)
            and math.exp(ppl.difference) > thresholds.unit_ppl_ratio):
        worse.append(ppl)
    return [Finding(WARN, "calibrated scales do worse than unit scales: " + describe_difference(d)) for d in worse]


def describe_difference(d: PairedDifference) -> str:
    """One comparison as a reader checks it: both values, the difference and its interval, over what."""
    if d.measure == "nll":
        values = (f"perplexity {math.exp(d.ours):.4f} vs {math.exp(d.theirs):.4f}, log-perplexity difference "
                  f"{d.difference:+.4f}, 95 % interval [{d.low:+.4f}, {d.high:+.4f}]")
    elif d.measure == "top1_agreement":
        values = (f"top-1 agreement {d.ours:.2%} vs {d.theirs:.2%}, difference {d.difference:+.2%}, 95 % interval "
                  f"[{d.low:+.2%}, {d.high:+.2%}]")
    else:
        values = (f"mean KL {d.ours:.4g} vs {d.theirs:.4g}, difference {d.difference:+.2g}, 95 % interval "
                  f"[{d.low:+.2g}, {d.high:+.2g}]")
    return f"{values} (paired over {d.sequences} held-out sequences, {d.tokens} tokens)"


def engine_unit_scale_notes(engines: Sequence[EngineResult]) -> list[str]:
    """`unit_scale_note` of each released engine that runs these scales, a note several engines share once,
    naming them."""
    named: dict[str, list[str]] = {}
    for engine in engines:
        note = unit_scale_note(engine.accuracy) if engine.accuracy and engine.known_by and not engine.unread else None
        if note:
            named.setdefault(note, []).append(engine.engine)
    return [f"{_engines(names)}: {note}" for note, names in named.items()]


def unit_scale_note(accuracy: Accuracy) -> str | None:
    """How these scales compare with unit scales where the verdict found nothing worse: the leading measure's
    interval, and when it cannot tell the two apart, about how many held-out tokens would."""
    by = {d.measure: d for d in accuracy.versus_unit}
    kl = by.get("kl_mean")
    if kl is not None and kl.sequences < MIN_PAIRED_SEQUENCES:
        return (f"{kl.sequences} held-out sequences are too few to compare these scales with unit scales (a paired "
                f"interval needs at least {MIN_PAIRED_SEQUENCES}; --num-samples)")
    if kl is None or kl.says_worse():
        return None
    if kl.says_better():
        return "these scales do better than unit scales: " + describe_difference(kl)
    needed = kl.tokens_to_tell()
    more = f"; about {needed} held-out tokens would tell them apart (--num-samples)" if needed else ""
    return "on this text these scales and unit scales cannot be told apart: " + describe_difference(kl) + more


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
