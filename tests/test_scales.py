"""Scale math: the formula, its round-up guard, strategies, saturation and the refusal of bad layers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8kv.observe import NUM_BINS, KVStatistics
from fp8kv.calibrate.scales import compute_scales, saturation_share, scale_from_amax
from fp8kv.options import Strategy
from fp8kv.errors import Fp8kvError


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=2.0**-100, max_value=2.0**100, allow_nan=False, width=32), st.sampled_from(["fp8_e4m3", "fp8_e5m2"]))
def test_stored_scale_never_lets_amax_exceed_max(amax, kv_dtype):
    limit = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[kv_dtype]
    a = torch.tensor([amax], dtype=torch.float32)
    scale = scale_from_amax(a, kv_dtype)
    assert scale.dtype == torch.float32
    assert a.double().item() <= scale.double().item() * limit
    assert (a / scale).item() <= limit
    # Rounded up by at most one float32 step from the exact quotient.
    below = torch.nextafter(scale, torch.zeros_like(scale))
    assert a.double().item() > below.double().item() * limit


def test_round_up_happens_where_division_rounds_down():
    amax = torch.tensor([1.0000001, 3.3, 7.77, 0.123456], dtype=torch.float32)
    scale = scale_from_amax(amax)
    assert (amax.double() <= scale.double() * 448).all()
    assert torch.equal(scale_from_amax(torch.tensor([448.0])), torch.tensor([1.0]))


def test_headroom_multiplies_and_must_be_at_least_one():
    assert scale_from_amax(torch.tensor([448.0]), headroom=1.5).item() == 1.5
    with pytest.raises(Fp8kvError, match="--headroom 0.5 is below 1.0: a scale under amax/MAX clips values it has seen"):
        scale_from_amax(torch.tensor([1.0]), headroom=0.5)
    for bad in (float("inf"), float("nan")):  # an infinite margin would write infinite scales
        with pytest.raises(Fp8kvError, match=f"--headroom {bad:g} is not a finite number"):
            scale_from_amax(torch.tensor([1.0]), headroom=bad)


@pytest.mark.parametrize("text", ["amax", "mse", "percentile:99.9", "percentile:100"])
def test_strategy_round_trips(text):
    assert str(Strategy.parse(text)) == text


@pytest.mark.parametrize("text", ["max", "percentile", "percentile:0", "percentile:101", "percentile:x", "mse:3"])
def test_bad_strategy_is_one_clear_error(text):
    with pytest.raises(Fp8kvError, match="use amax, mse, last-batch, or percentile:P"):
        Strategy.parse(text)


def statistics_from(values: dict[tuple[int, int], torch.Tensor], layers: int = 2, heads: int = 2) -> KVStatistics:
    """Fold given K/V tensors [tokens, heads, dim] per (layer, kind) through the real observer."""
    stats = KVStatistics.empty(layers, heads)
    for layer in range(layers):
        k = values.get((layer, 0), torch.ones(4, heads, 2))
        v = values.get((layer, 1), torch.ones(4, heads, 2))
        stats.fold(layer, _as_cache(k), _as_cache(v), None)
    return stats


def test_amax_strategy_saturates_nothing_and_percentile_clips_outliers():
    torch.manual_seed(0)
    k = torch.randn(1000, 2, 8) * 0.1
    k[0, 1, 0] = 50.0  # one outlier in head 1
    stats = statistics_from({(0, 0): k})
    amax_table = compute_scales(stats, (0, 1))
    assert amax_table.saturation[0, 0].item() == 0.0
    assert amax_table.scales[0, 0].item() == pytest.approx(50.0 / 448, rel=1e-6)
    pct = compute_scales(stats, (0, 1), strategy=Strategy.parse("percentile:99.9"))
    assert pct.scales[0, 0].item() < 1.0 / 448  # well below the outlier
    assert 0.0 < pct.saturation[0, 0].item() <= 0.002
    # fp8 is a float format: clipping a lone outlier costs more than it gains, so mse keeps it.
    mse = compute_scales(stats, (0, 1), strategy=Strategy.parse("mse"))
    assert mse.scales[0, 0].item() == amax_table.scales[0, 0].item()


def test_mse_clips_when_the_top_bin_is_crowded():
    # Most values sit just under amax, where e4m3 steps are coarsest (416 -> 448): a slightly
    # lower clip puts them on a finer grid and wins.
    k = torch.full((1000, 1, 1), 0.96)
    k[0] = 1.0
    stats = statistics_from({(0, 0): k}, heads=1)
    mse = compute_scales(stats, (0, 1), strategy=Strategy.parse("mse"))
    assert mse.scales[0, 0].item() < 1.0 / 448


def test_per_head_scales_have_kv_head_shape():
    k = torch.ones(4, 2, 2)
    k[:, 1] = 4.0
    table = compute_scales(statistics_from({(0, 0): k}), (0, 1), per_head=True)
    tensors = table.tensors(0)
    assert tensors[0].shape == (2, 1, 1)
    assert tensors[0].flatten().tolist() == pytest.approx([1 / 448, 4 / 448], rel=1e-6)
    assert compute_scales(statistics_from({}), (0, 1)).tensors(1)[1].shape == (1,)


def test_zero_never_observed_and_nan_layers_are_refused_by_name():
    stats = statistics_from({(1, 1): torch.zeros(4, 2, 2)}, layers=3)
    stats.tokens[2] = 0
    stats.amax[2] = 0.0
    with pytest.raises(Fp8kvError, match=r"all-zero K or V in layers \[1\]; layers \[2\] were never observed"):
        compute_scales(stats, (0, 1, 2))
    allowed = compute_scales(stats, (0, 1, 2), allow_unobserved=True)
    assert allowed.defaulted == (1, 2) and allowed.scales[1:].eq(1.0).all()
    stats.amax[0, 0, 1] = float("nan")
    with pytest.raises(Fp8kvError, match=r"NaN or infinite in layers \[0\]"):
        compute_scales(stats, (0, 1, 2), allow_unobserved=True)


def test_skipped_layers_need_no_statistics():
    stats = statistics_from({}, layers=3)
    stats.tokens[1] = 0
    assert compute_scales(stats, (0, 2)).layers == (0, 2)


def test_saturation_share_is_exact_at_amax_and_counts_above_threshold():
    hist = torch.zeros(NUM_BINS, dtype=torch.int64)
    stats = statistics_from({(0, 0): torch.tensor([1.0, 2.0, 4.0, 8.0]).view(4, 1, 1)}, heads=1)
    hist = stats.hist[0, 0, 0]
    assert saturation_share(hist, torch.tensor(8.0), torch.tensor(8.0)).item() == 0.0
    assert saturation_share(hist, torch.tensor(8.0), torch.tensor(3.0)).item() == 0.5


def test_histogram_counts_every_real_value_once():
    stats = statistics_from({(0, 0): torch.randn(10, 2, 4)})
    assert stats.hist[0, 0].sum().item() == 10 * 2 * 4
    assert stats.tokens.tolist() == [10, 4]


def _as_cache(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] as a cache holds it: [1, heads, tokens, dim]."""
    return x.permute(1, 0, 2).unsqueeze(0)
