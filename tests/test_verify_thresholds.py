"""Verify thresholds: packaged defaults, file and flag overrides, refused files, and the verdict order."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fp8kv.engine_models import engine_model
from fp8kv.errors import Fp8kvError
from fp8kv.verify.engines import engine_reasons
from fp8kv.verify.results import Accuracy, EngineResult, LayerCheck
from fp8kv.json_fields import to_json_value
from fp8kv.checks import FAIL, INFO, WARN, Finding
from fp8kv.verify.verdict import (
    Thresholds, UnitComparison, accuracy_reasons, engine_accuracy_reasons, engine_unit_scale_notes, heldout_reasons,
    load_thresholds, unit_scale_reasons, verdict, warned_engines,
)
from fp8kv.verify.verdict import describe_difference as describe

ACCURACY = Accuracy(ppl_bf16=9.9, ppl_fp8=10.0, ppl_fp8_unit=10.0, kl_mean=0.001, kl_max=0.01, top1_agreement=0.99,
                    kl_mean_unit=0.001, kl_max_unit=0.01, top1_agreement_unit=0.99)


def test_packaged_defaults_then_file_then_flags(tmp_path):
    defaults = load_thresholds()
    assert defaults == Thresholds(kl_mean=0.05, saturation=1e-4, unit_kl_ratio=1.25, false_alarm_rate=0.05)
    path = tmp_path / "t.toml"
    path.write_text("[fail]\nkl_mean = 0.2\n[warn]\nsaturation = 0.01\n")
    from_file = load_thresholds(path)
    assert (from_file.kl_mean, from_file.saturation, from_file.unit_kl_ratio) == (0.2, 0.01, 1.25)
    assert load_thresholds(path, kl_mean=0.3, saturation=None).kl_mean == 0.3
    assert load_thresholds(path, kl_mean=0.3, saturation=None).saturation == 0.01


@pytest.mark.parametrize("text, message", [
    ("[warn]\nkl_mean = 0.1\n", r"unknown threshold \[warn\] kl_mean; known: \[fail\] kl_mean"),
    ("[fail]\nkl_mean = -1\n", r"\[fail\] kl_mean = -1 must be a number >= 0"),
    ("[fail\n", r"not valid TOML"),
])
def test_bad_threshold_files_are_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(Fp8kvError, match=rf"^{path}: .*{message}" if "TOML" not in message else message):
        load_thresholds(path)


def test_verdict_takes_the_worst_level_and_info_never_counts():
    assert verdict([Finding(INFO, "x")]) == "PASS"
    assert verdict([Finding(INFO, "x"), Finding(WARN, "y")]) == "WARN"
    assert verdict([Finding(WARN, "y"), Finding(FAIL, "z")]) == "FAIL"


def test_accuracy_reasons_bound_kl_nan_and_unit_scales():
    t = load_thresholds()
    assert accuracy_reasons(ACCURACY, {}, t) == []
    nan = accuracy_reasons(replace(ACCURACY, kl_mean=math.nan, ppl_fp8=math.nan), {1: 3}, t)
    assert [r.level for r in nan] == [FAIL, FAIL] and nan[0].message == "NaN/inf values in the clamped fp8 cache: layer 1 (3)"
    assert [r.level for r in accuracy_reasons(replace(ACCURACY, kl_mean=0.06), {}, t)] == [FAIL]
    # the comparison with unit scales is judged over the whole family of engines, not per accuracy
    assert [r.level for r in accuracy_reasons(replace(ACCURACY, kl_mean=0.06, versus_unit=(
        _paired("kl_mean", 0.06, 0.001),)), {}, t)] == [FAIL]
    (worse,) = unit_scale_reasons([UnitComparison(_paired("kl_mean", 0.06, 0.001))], t)
    assert worse.level == WARN and worse.message.startswith(
        "calibrated scales do worse than unit scales: mean KL 0.06 vs 0.001")
    assert worse.message.endswith("; p = 1.5e-05, significant at a 5% false-alarm rate over 1 comparison (Holm)")


def _paired(measure: str, ours: float, theirs: float, spread: float = 0.0, sequences: int = 16):
    """A paired comparison of per-token means `ours` and `theirs` over `sequences` of 200 tokens, the gap varying
    by +-`spread` (alternating) from one sequence to the next."""
    from fp8kv.verify.intervals import paired_difference

    tokens = [200] * sequences
    gap = [(ours - theirs + (spread if i % 2 else -spread)) * n for i, n in enumerate(tokens)]
    return paired_difference(measure, [theirs * n + g for n, g in zip(tokens, gap)], [theirs * n for n in tokens],
                             tokens)


def test_the_sign_flip_interval_is_exact_paired_and_narrows_with_more_sequences():
    few, many = _paired("kl_mean", 0.011, 0.010, 0.004, 8), _paired("kl_mean", 0.011, 0.010, 0.004, 128)
    assert few == _paired("kl_mean", 0.011, 0.010, 0.004, 8)  # the same numbers on every run
    assert few.low < few.difference < few.high and abs(few.difference - 0.001) < 1e-12
    assert many.high - many.low < (few.high - few.low) / 2
    assert (few.sequences, few.tokens, many.tokens) == (8, 1600, 25600)
    # 8 sequences, 4 of them +0.005 and 4 -0.003 per token: the subsets whose mean is <= 0 and the identity
    assert few.p_worse == (sum(1 for code in range(1, 256)
                               if sum((0.005 if i % 2 else -0.003) for i in range(8) if code >> i & 1) <= 0) + 1) / 256
    # with 5 sequences no interval can be had at 95 %: 32 sign patterns leave no subset mean to each tail
    assert _paired("kl_mean", 0.011, 0.010, 0.004, 5).low == -math.inf


def test_the_sign_flip_test_holds_its_false_alarm_rate_on_few_sequences():
    """No true difference, 8 sequences of unequal lengths with heavy-tailed symmetric noise: at most 5 % of draws say
    worse at p <= 0.05 and at least 95 % of intervals hold zero (the bootstrap it replaced missed at 8 sequences)."""
    import torch

    from fp8kv.verify.intervals import paired_difference

    generator = torch.Generator().manual_seed(1)
    draws, alarms, missed = 600, 0, 0
    for _ in range(draws):
        tokens = torch.randint(50, 300, (8,), generator=generator)
        noise = torch.distributions.StudentT(3.0).sample((8,)) * tokens.double().sqrt() * 0.01
        base = torch.rand(8, generator=generator, dtype=torch.float64) * tokens * 0.02
        d = paired_difference("kl_mean", (base + noise).tolist(), base.tolist(), tokens.tolist())
        alarms += d.p_worse <= 0.05
        missed += not d.low <= 0 <= d.high
    # binomial sd at 5 % of 600 draws is 5.3: three of them above the rate is a failure of the test, not chance
    assert alarms <= 0.05 * draws + 16 and missed <= 0.05 * draws + 16, (alarms, missed)


def test_holm_holds_the_family_and_a_lone_comparison_keeps_its_power():
    from fp8kv.verify.verdict import holm

    assert holm([0.01], 0.05) == [True]
    assert holm([0.01] * 7, 0.05) == [False] * 7  # seven engines at p = 0.01 each: what chance alone gives
    assert holm([0.004, 0.3, 0.012], 0.05) == [True, False, True]  # 0.004 < 0.05/3, then 0.012 < 0.05/2
    assert holm([], 0.05) == []


def test_top1_and_perplexity_are_notes_and_never_warn():
    # make demo's case: perplexity above unit scales' while KL and top-1 say the calibrated scales are better
    t = load_thresholds()
    worse_by_top1 = (_paired("kl_mean", 0.01044, 0.01429, 0.001), _paired("top1_agreement", 0.90, 0.95),
                     _paired("nll", math.log(4.5058), math.log(4.4390), 0.001))
    assert worse_by_top1[1].says_worse() and worse_by_top1[2].says_worse()
    results = [EngineResult("a@1", 4.5, 0, 100, 0, 16, None, "src", "PASS", known_by="run",
                            accuracy=replace(ACCURACY, versus_unit=worse_by_top1))]
    assert engine_accuracy_reasons(results, t) == []
    (note,) = engine_unit_scale_notes(results, t)
    assert note.startswith("engine a@1: these scales do better than unit scales: mean KL 0.01044 vs 0.01429")


def test_report_json_has_no_nan():
    assert to_json_value({"a": [math.nan, 1.0], "b": {"c": math.inf}, "d": "x"}) == {"a": [None, 1.0], "b": {"c": None}, "d": "x"}


def test_warnings_explain_their_numbers_and_the_fix():
    thresholds = load_thresholds()
    row = LayerCheck(3, k_max_ratio=400.0, v_max_ratio=483.84, k_saturation=0.0, v_saturation=0.0002, nan_with_clamp=0)
    (saturation, fix) = heldout_reasons([row], thresholds, 448.0, headroom=1.25)
    assert saturation.message == (
        "layer 3: 0.020% of V values saturate at ±448 (WARN above 0.010%); the largest |x|/scale is 483.8, 8.0% past "
        "the calibrated range")
    # 1.25 x 483.84 / 448 = 1.35: the absolute value to type, not a factor on the 1.25 already applied
    assert fix.message == (
        "engines that clamp store those values as ±448. Fix: recalibrate on the same text with --headroom 1.35 (the "
        "scales were made with 1.25; 1.35 makes every scale x1.080; e4m3's relative precision is the same across its "
        "range, so this costs almost nothing), or on text like this.")
    (_, foreign) = heldout_reasons([row], thresholds, 448.0)
    assert "every scale x1.08 or more" in foreign.message and "not made by fp8kv" in foreign.message


def test_several_saturating_layers_get_one_fix_that_covers_them_all():
    rows = [LayerCheck(i, k_max_ratio=450.0 + i, v_max_ratio=460.0 + 7 * i, k_saturation=0.0002, v_saturation=0.0003,
                       nan_with_clamp=0)
            for i in range(3)]
    reasons = heldout_reasons(rows, load_thresholds(), 448.0, headroom=1.0)
    assert len(reasons) == 7 and sum("--headroom" in r.message for r in reasons) == 1
    assert reasons[-1].message.startswith("engines that clamp store those values as ±448. Fix for every layer: "
                                          "recalibrate on the same text with --headroom 1.06 ")  # 474 / 448, the worst
    assert not any("--headroom" in r.message for r in heldout_reasons(rows, load_thresholds(), 448.0, with_fix=False))


def test_an_engine_that_writes_nan_fails_by_name_with_the_fix():
    lost = EngineResult("sglang@0.5.17", ppl=math.nan, nan_rows=512, rows=3234, sequences_lost=2, sequences=16,
                        first_nonfinite_layer=3, source=engine_model("sglang@0.5.17").source, verdict=FAIL)
    clean = EngineResult("vllm-tpu", ppl=37.7, nan_rows=0, rows=3234, sequences_lost=0, sequences=16,
                         first_nonfinite_layer=None, source=engine_model("vllm-tpu").source, verdict="PASS")
    bug = replace(lost, engine="no-clamp", verdict="bug model")
    (reason,) = engine_reasons([clean, lost, bug], 483.84, 448.0, headroom=1.0)
    assert reason.level == "FAIL"
    assert reason.message.startswith("engine sglang@0.5.17 (past the fp8 maximum it stores NaN above 464 for e4m3 (±inf "
                                     "from 61440 for e5m2): cast without a clamp): 512 of 3234 logit rows NaN/inf, "
                                     "2 of 16 sequences lost; first NaN/inf in the cache of layer 3. Fix: recalibrate "
                                     "on the same text with --headroom 1.08")


def test_a_pass_says_when_calibrated_and_unit_scales_cannot_be_told_apart_and_what_would():
    from fp8kv.verify.verdict import sequences_to_judge, unit_scale_note

    noisy = _paired("kl_mean", 0.0105, 0.0104, 0.002)
    note = unit_scale_note(noisy, 8, "not significant")
    assert note.startswith("on this text these scales and unit scales cannot be told apart: mean KL 0.0105 vs 0.0104, "
                           "difference +0.0001, 95 % interval [-")
    needed = noisy.tokens_to_tell()
    assert needed is not None and needed > noisy.tokens and f"about {needed} held-out tokens" in note
    better = unit_scale_note(_paired("kl_mean", 0.0104, 0.0143, 0.001), 8, "not significant")
    assert better.startswith("these scales do better than unit scales: mean KL 0.0104 vs 0.0143")
    # 7 comparisons at 5 %: Holm's first bound is 0.05 / 7, and n sequences give no p-value below 2^-n
    assert sequences_to_judge(load_thresholds(), 7) == 8 and sequences_to_judge(load_thresholds(), 1) == 5
    few = _paired("kl_mean", 0.02, 0.01, sequences=4)
    assert unit_scale_reasons([UnitComparison(few)], load_thresholds()) == []  # 4 sequences: p >= 1/16
    assert unit_scale_note(few, 8, "not significant") == ("4 held-out sequences are too few to compare these scales with unit scales "
                                       "(this many comparisons at this false-alarm rate need at least 8; --num-samples)")


def test_scales_far_too_small_are_told_to_recalibrate_not_to_widen_the_margin():
    from fp8kv.verify.verdict import headroom_fix

    # the value to pass: the margin the scales were made with times the factor they fall short by
    assert headroom_fix(448 * 1.05, 448, 1.25).startswith("Fix: recalibrate on the same text with --headroom 1.32 "
                                                         "(the scales were made with 1.25; 1.32 makes every scale x1.056")
    assert headroom_fix(448 * 1.075, 448, 1.0).startswith("Fix: recalibrate on the same text with --headroom 1.08 ")
    assert headroom_fix(448 * 16, 448, 1.0).startswith("Fix: recalibrate on the same text with --headroom 16.00 ")
    assert headroom_fix(448 * 1.0001, 448, 1.25).startswith("Fix: recalibrate on the same text with --headroom 1.26 ")
    assert headroom_fix(448 * 1.3, 448).startswith("Fix: every scale x1.30 or more")  # not fp8kv's: no --headroom
    assert headroom_fix(448 * 3.5e28, 448) == (
        "Fix: these scales are 3.5e+28x too small for this text, far beyond what a margin is for: recalibrate "
        "(fp8kv calibrate) on text like this, or check how the scales were made.")
    assert "too small" in headroom_fix(float("inf"), 448)


def test_each_engine_is_judged_on_its_own_runs_and_a_shared_finding_names_every_engine():
    worse = replace(ACCURACY, kl_mean=0.06, versus_unit=(_paired("kl_mean", 0.06, 0.001),))

    def engine(name: str, accuracy: Accuracy, **kwargs) -> EngineResult:
        return EngineResult(name, accuracy.ppl_fp8, 0, 100, 0, 8, None, "src", "PASS", known_by="run",
                            accuracy=accuracy, **kwargs)

    better = replace(ACCURACY, versus_unit=(_paired("kl_mean", 0.0104, 0.0143, 0.001),))
    results = [engine("a@1", worse), engine("b@2", worse), engine("c@3", better),
               engine("d@4", worse, unread="it reads none of them"),  # at 1.0: its INFO line says so
               replace(engine("bug", worse), known_by=""),  # a bug model illustrates, it is not judged
               replace(engine("e@5", worse), nan_rows=3)]  # lost logits: a FAIL of its own already
    found = engine_accuracy_reasons(results, load_thresholds())
    assert [r.level for r in found] == [FAIL, WARN]
    assert found[0].message.startswith("engines a@1, b@2: mean KL to the bf16 cache 0.06 nats exceeds the bound")
    assert found[1].message.startswith("engines a@1, b@2: calibrated scales do worse than unit scales: mean KL 0.06")
    # a@1 and b@2 share one comparison and c@3 has another: a family of two
    assert "significant at a 5% false-alarm rate over 2 comparisons (Holm). On those engines, serve this model with a " \
           "bf16 cache or at scale 1.0" in found[1].message
    assert [r.engines for r in found] == [("a@1", "b@2"), ("a@1", "b@2")]
    assert warned_engines(found) is None  # a FAIL is a FAIL
    assert warned_engines(found[1:]) == ("a@1", "b@2")
    assert warned_engines(found[1:] + [Finding(WARN, "layer 3: 0.020% of V values saturate")]) is None  # the scales'
    assert warned_engines([Finding(INFO, "x", ("c@3",))]) is None  # a PASS
    assert engine_unit_scale_notes([engine("c@3", better), engine("d@4", better, unread="x")], load_thresholds()) == [
        "engine c@3: these scales do better than unit scales: " + describe(better.versus_unit[0])]
    # significant and consistent, but a tenth above the unit-scale KL: a note that says why it is let pass
    slightly = replace(ACCURACY, versus_unit=(_paired("kl_mean", 0.0110, 0.0100, 0.0001),))
    (note,) = engine_unit_scale_notes([engine("c@3", slightly)], load_thresholds())
    assert note.startswith("engine c@3: unit scales give a lower mean KL on this text (1.10x the unit-scale KL, "
                           "within the 1.25x the verdict allows): mean KL 0.011 vs 0.01")
    assert engine_accuracy_reasons([engine("c@3", slightly)], load_thresholds()) == []
