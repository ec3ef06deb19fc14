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
DEFAULTS_FILE = "verify.toml"
# Which TOML table each threshold lives in.
_SECTIONS = {"kl_mean": "fail", "saturation": "warn", "unit_kl_ratio": "warn", "false_alarm_rate": "warn"}


@dataclass(frozen=True)
class Thresholds:
    """Bounds of the verdict; the defaults and their meaning live in configs/verify.toml."""

    kl_mean: float
    saturation: float
    unit_kl_ratio: float
    false_alarm_rate: float


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


def verdict(reasons: Sequence[Finding]) -> Verdict:
    """FAIL if any reason fails, else WARN if any warns, else PASS."""
    levels = {r.level for r in reasons}
    return "FAIL" if FAIL in levels else "WARN" if WARN in levels else "PASS"


def warned_engines(reasons: Sequence[Finding]) -> tuple[str, ...] | None:
    """The engines a WARN verdict is about alone: every WARN names the engines it is about, and nothing FAILs. None
    when the verdict is not WARN or a warning is about the scales themselves."""
    warnings = [r for r in reasons if r.level == WARN]
    if verdict(reasons) != "WARN" or not all(r.engines for r in warnings):
        return None
    return tuple(dict.fromkeys(name for r in warnings for name in r.engines))


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


@dataclass(frozen=True)
class UnitComparison:
    """One test of the family: these scales' mean KL against unit scales on one write, and the engines that run it
    (none when it is fp8kv's own cache)."""

    kl: PairedDifference
    engines: tuple[str, ...] = ()


def judged(engines: Sequence[EngineResult]) -> list[EngineResult]:
    """The released engines whose accuracy is judged: they read these scales and kept every logit (one that lost
    logits fails on that alone, in `verify.engines`; one at scale 1.0 says so in its own INFO line)."""
    return [e for e in engines if e.accuracy is not None and not e.unread and e.known_by and not e.nan_rows]


def engine_accuracy_reasons(engines: Sequence[EngineResult], thresholds: Thresholds) -> list[Finding]:
    """`accuracy_reasons` of each judged engine on its own runs, a finding several engines share naming them all
    once; then `unit_scale_reasons` over all of their comparisons with unit scales as one family."""
    named: dict[tuple[str, str], list[str]] = {}
    for engine in judged(engines):
        assert engine.accuracy is not None  # judged
        for reason in accuracy_reasons(engine.accuracy, {}, thresholds):
            named.setdefault((reason.level, reason.message), []).append(engine.engine)
    found = [Finding(level, f"{_engines(names)}: {message}", tuple(names)) for (level, message), names in named.items()]
    return found + unit_scale_reasons(unit_comparisons(engines), thresholds)


def unit_comparisons(engines: Sequence[EngineResult]) -> list[UnitComparison]:
    """The family of tests: each distinct KL comparison of the judged engines (engines that share a write at both
    scales share the comparison: one test, not several)."""
    named: dict[PairedDifference, list[str]] = {}
    for engine in judged(engines):
        assert engine.accuracy is not None  # judged
        kl = _kl(engine.accuracy)
        if kl is not None:
            named.setdefault(kl, []).append(engine.engine)
    return [UnitComparison(kl, tuple(names)) for kl, names in named.items()]


def _engines(names: Sequence[str]) -> str:
    return f"engine {names[0]}" if len(names) == 1 else "engines " + ", ".join(names)


def _kl(accuracy: Accuracy) -> PairedDifference | None:
    return next((d for d in accuracy.versus_unit if d.measure == "kl_mean"), None)


def accuracy_reasons(accuracy: Accuracy, nan_with_clamp: dict[int, int], thresholds: Thresholds) -> list[Finding]:
    """NaN with clamping, non-finite logits and the KL bound: each a FAIL."""
    reasons = clamped_nan_reasons(nan_with_clamp)
    kl = accuracy.kl_mean
    if not _finite(kl) or not _finite(accuracy.ppl_fp8):
        reasons.append(Finding(FAIL, "the fp8 cache with these scales gives NaN/inf logits"))
        return reasons
    if kl > thresholds.kl_mean:
        reasons.append(Finding(FAIL, f"mean KL to the bf16 cache {kl:.4g} nats exceeds the bound {thresholds.kl_mean:g}"))
    return reasons


def unit_scale_reasons(family: Sequence[UnitComparison], thresholds: Thresholds) -> list[Finding]:
    """A WARN for each comparison in which these scales do worse than unit scales, judged as one family.

    The measure is mean KL alone: top-1 agreement turns on flips of near-tied tokens, which move with the CPU's
    bf16 arithmetic, and the perplexity of a few hundred tokens moves with the text by more than the effect; both
    are reported, neither decides. Holm's procedure over the family's sign-flip p-values holds the chance that a
    good checkpoint WARNs at all to `false_alarm_rate`, however many engines are compared. A significant
    difference must also be past the least effect worth a warning: these scales' KL above `unit_kl_ratio` x
    the unit-scale KL, by more than `UNIT_KL_NOISE` (fp8 rounding alone moves KL that much, the same way on
    every sequence)."""
    rate, tests = thresholds.false_alarm_rate, "comparison" if len(family) == 1 else "comparisons"
    return [Finding(WARN, _worse_than_unit(c, f"{rate:.0%} false-alarm rate over {len(family)} {tests}"), c.engines)
            for c, tolerated in zip(family, _tolerances(family, thresholds)) if not tolerated]


def _worse_than_unit(comparison: UnitComparison, family: str) -> str:
    """The WARN's line: who, the comparison, its significance in the `family`, and what a user of the engine does."""
    names, kl = comparison.engines, comparison.kl
    line = (f"calibrated scales do worse than unit scales: {describe_difference(kl)}; p = {kl.p_worse:.2g}, "
            f"significant at a {family} (Holm)")
    if not names:
        return line
    where = "that engine" if len(names) == 1 else "those engines"
    return (f"{_engines(names)}: {line}. On {where}, serve this model with a bf16 cache or at scale 1.0 (the source "
            "checkpoint), or recalibrate on text like what it serves")


def holm(p_values: list[float], rate: float) -> list[bool]:
    """Which of the hypotheses Holm's step-down procedure rejects with a family-wise error rate of `rate`: the
    i-th smallest p-value (from 0) is held against rate / (m - i), stopping at the first that is not below it."""
    rejected = [False] * len(p_values)
    for rank, i in enumerate(sorted(range(len(p_values)), key=p_values.__getitem__)):
        if p_values[i] > rate / (len(p_values) - rank):
            break
        rejected[i] = True
    return rejected


def _tolerances(family: Sequence[UnitComparison], thresholds: Thresholds) -> list[str]:
    """Per comparison, why the verdict lets it pass (`_tolerated`); "" where it is significant in the family and
    past the least effect worth a warning."""
    significant = holm([c.kl.p_worse for c in family], thresholds.false_alarm_rate)
    return [_tolerated(c, s, thresholds) for c, s in zip(family, significant)]


def _tolerated(comparison: UnitComparison, significant: bool, thresholds: Thresholds) -> str:
    """Why the verdict lets a comparison pass where these scales may do worse, or "" where it warns."""
    kl = comparison.kl
    if not significant:
        return f"not significant at a {thresholds.false_alarm_rate:.0%} false-alarm rate over the family (p = {kl.p_worse:.2g})"
    if not kl.ours > kl.theirs * thresholds.unit_kl_ratio:
        return (f"{kl.ours / kl.theirs:.2f}x the unit-scale KL, within the {thresholds.unit_kl_ratio:g}x the verdict "
                "allows")
    if not kl.difference > UNIT_KL_NOISE:
        return f"within fp8 rounding's {UNIT_KL_NOISE:g} nats"
    return ""


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


def sequences_to_judge(thresholds: Thresholds, comparisons: int) -> int:
    """The fewest held-out sequences whose sign-flip test can reach Holm's first bound, rate / comparisons: n
    sequences give no p-value below 2^-n."""
    return max(1, math.ceil(math.log2(max(comparisons, 1) / thresholds.false_alarm_rate)))


def engine_unit_scale_notes(engines: Sequence[EngineResult], thresholds: Thresholds) -> list[str]:
    """How each comparison of the family came out where the verdict found nothing worse, a note several engines
    share said once, naming them."""
    return unit_scale_notes(unit_comparisons(engines), thresholds)


def unit_scale_notes(family: Sequence[UnitComparison], thresholds: Thresholds) -> list[str]:
    """`engine_unit_scale_notes` of a family of comparisons (fp8 engines' or NVFP4 engine paths')."""
    needed = sequences_to_judge(thresholds, len(family))
    return [f"{_engines(c.engines)}: {unit_scale_note(c.kl, needed, why)}"
            for c, why in zip(family, _tolerances(family, thresholds)) if why]


def unit_scale_note(kl: PairedDifference, needed: int, tolerated: str) -> str:
    """How these scales compare with unit scales on mean KL where the verdict found nothing worse (`tolerated`: why):
    the interval, and when it cannot tell the two apart, about how many held-out tokens would; `needed`: the
    fewest sequences the family's test can judge on."""
    if kl.sequences < needed:
        return (f"{kl.sequences} held-out sequences are too few to compare these scales with unit scales (this many "
                f"comparisons at this false-alarm rate need at least {needed}; --num-samples)")
    if kl.says_worse():
        return f"unit scales give a lower mean KL on this text ({tolerated}): " + describe_difference(kl)
    if kl.says_better():
        return "these scales do better than unit scales: " + describe_difference(kl)
    more_tokens = kl.tokens_to_tell()
    more = f"; about {more_tokens} held-out tokens would tell them apart (--num-samples)" if more_tokens else ""
    return "on this text these scales and unit scales cannot be told apart: " + describe_difference(kl) + more


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
