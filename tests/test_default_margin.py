"""The default margin: default scales pass verify on unseen text; fp8kv.json recomputes every scale exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fp8kv.data import DataRequest
from fp8kv.observe import KVStatistics
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate, observe_whole_model
from fp8kv.data import load_tokenizer
from fp8kv.calibrate.scales import compute_scales
from fp8kv.options import DEFAULT_HEADROOM
from fp8kv.options import Strategy
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.engine_models import RELEASED
from fp8kv.tools.factory import ARCHITECTURES
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import verify

SCALES_FILE = "kv_scales.safetensors"


@pytest.mark.parametrize("model", ["bundled", "bundled-outliers", *ARCHITECTURES])
def test_a_default_calibration_passes_verify_on_held_out_text(model, tmp_path, factory_checkpoint):
    source = model if model.startswith("bundled") else str(factory_checkpoint(model))
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=16, seq_len=128)
    calibrate(CalibrationRequest(model=source, out=tmp_path / "c", data=data))
    held_out = DataRequest("bundled", num_samples=8, seq_len=128)  # the bundled held-out split, never calibrated on
    # on every released engine: the verdict is not to turn on near-tied tokens, which flip with the CPU's arithmetic
    result = verify(VerifyRequest(tmp_path / "c", data=held_out, batch_size=8, num_prompts=2, prompt_len=16,
                                  new_tokens=2, device="cpu", engines=RELEASED))
    assert result.verdict == "PASS", result.report.reasons


def recompute(clip: float, headroom: float, fp8_max: float) -> np.float32:
    """The recorded formula, in plain numpy float32: clip / MAX * headroom, raised until clip / scale <= MAX."""
    clip32, limit = np.float32(clip), np.float32(fp8_max)
    scale = clip32 / limit * np.float32(headroom)
    while float(clip32) > float(scale) * fp8_max or clip32 / scale > limit:
        scale = np.nextafter(scale, np.float32(np.inf))
    return scale


def _calibrate_cli(out: Path, *extra: str) -> dict:
    args = ["calibrate", "bundled", "--out", str(out), "--dataset", str(BUNDLED_CALIBRATION_TEXT),
            "--num-samples", "8", "--seq-len", "64", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "fp8kv.json").read_text())


def _recorded_and_written(out: Path, record: dict) -> list[tuple[np.float32, torch.Tensor]]:
    tensors = load_file(out / SCALES_FILE)
    pairs = []
    for row in record["layers"]:
        for kind in ("k", "v"):
            assert row["headroom"] == record["headroom"]
            expected = recompute(row[f"{kind}_clip"], row["headroom"], record["fp8_max"])
            pairs.append((expected, tensors[f"model.layers.{row['layer']}.self_attn.{kind}_scale"]))
    return pairs


def test_fp8kv_json_recomputes_every_scale_bit_for_bit(tmp_path):
    record = _calibrate_cli(tmp_path / "out")
    assert record["headroom"] == DEFAULT_HEADROOM > 1.0
    for expected, written in _recorded_and_written(tmp_path / "out", record):
        assert written.dtype == torch.float32 and written.shape == (1,)
        assert written.numpy().view(np.int32)[0] == np.array([expected]).view(np.int32)[0]
    row = record["layers"][0]
    assert row["k_clip"] == row["k_amax"] and row["v_clip"] == row["v_amax"]  # the amax strategy clips at amax


def test_headroom_one_reproduces_amax_over_448_exactly(tmp_path):
    record = _calibrate_cli(tmp_path / "out", "--headroom", "1.0")
    assert record["headroom"] == 1.0
    tensors = load_file(tmp_path / "out" / SCALES_FILE)
    for row in record["layers"]:
        for kind in ("k", "v"):
            amax = torch.tensor([row[f"{kind}_amax"]], dtype=torch.float32)
            written = tensors[f"model.layers.{row['layer']}.self_attn.{kind}_scale"]
            # amax / 448 as llm-compressor writes it, unless that rounds down so amax / scale > 448.
            plain = amax / 448.0
            rounded_down = bool(amax / plain > 448.0) or amax.double().item() > plain.double().item() * 448.0
            expected = torch.nextafter(plain, torch.tensor([np.inf])) if rounded_down else plain
            assert torch.equal(written.view(torch.int32), expected.view(torch.int32)), (row["layer"], kind)


def test_headroom_option_takes_auto_or_a_number_of_at_least_one(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "bundled", "--headroom", "0.9"])
    assert result.exit_code == 2 and "Invalid value for '--headroom': 0.9 is below 1.0" in result.output
    result = CliRunner().invoke(app, ["calibrate", "bundled", "--headroom", "wide"])
    assert result.exit_code == 2 and "Invalid value for '--headroom': 'wide' is neither auto nor a number" in result.output
    assert _calibrate_cli(tmp_path / "auto", "--headroom", "auto")["headroom"] == DEFAULT_HEADROOM


def test_last_batch_strategy_is_the_amax_of_the_last_batch_alone(factory_checkpoint):
    source = SourceCheckpoint.open(factory_checkpoint("llama"))
    tokenizer = load_tokenizer(source.path, False)
    from fp8kv.data import load_calibration_data

    data = load_calibration_data(DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=6, seq_len=48), tokenizer)
    request = CalibrationRequest(model=str(source.path), batch_size=1, device="cpu")
    g = source.geometry
    last = KVStatistics.empty(g.num_layers, g.num_kv_heads)
    everything = observe_whole_model(source, data, request, tokenizer, last_batch=last)
    from dataclasses import replace

    alone = observe_whole_model(source, replace(data, samples=data.samples[-1:]), request, tokenizer)
    mimic = compute_scales(everything, g.kv_layers, strategy=Strategy.parse("last-batch"), last_batch=last)
    expected = compute_scales(alone, g.kv_layers)
    assert torch.equal(mimic.scales, expected.scales)
    assert torch.equal(mimic.amax, compute_scales(everything, g.kv_layers).amax)  # amax stays the full one
    assert bool((mimic.scales <= compute_scales(everything, g.kv_layers).scales).all())
    with pytest.raises(Fp8kvError, match="needs the statistics of the last calibration batch"):
        compute_scales(everything, g.kv_layers, strategy=Strategy.parse("last-batch"))


def test_last_batch_strategy_refuses_layer_by_layer(factory_checkpoint):
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=2, seq_len=16)
    request = CalibrationRequest(model=str(factory_checkpoint("llama")), data=data, strategy="last-batch",
                                 layerwise=True)
    with pytest.raises(Fp8kvError, match="last-batch .* pass --no-layerwise"):
        calibrate(request)


def test_unit_scale_comparison_ignores_differences_within_rounding_noise():
    from fp8kv.verify.intervals import paired_difference
    from fp8kv.verify.verdict import UnitComparison, load_thresholds, unit_scale_reasons

    def reasons(kl: float, unit_kl: float) -> list[str]:
        tokens = [100] * 16
        # the same gap on every sequence, as fp8 rounding gives it: an interval that excludes zero
        ours = [kl * n * (1 + 0.01 * i) for i, n in enumerate(tokens)]
        theirs = [unit_kl * n * (1 + 0.01 * i) for i, n in enumerate(tokens)]
        family = [UnitComparison(paired_difference("kl_mean", ours, theirs, tokens))]
        return [r.message for r in unit_scale_reasons(family, load_thresholds())]

    assert reasons(4.0e-6, 3.0e-6) == []  # a random-weight llama: both negligible, the gap is rounding
    (worse,) = reasons(0.01, 0.002)
    assert worse.startswith("calibrated scales do worse than unit scales: mean KL 0.01075 vs 0.00215, difference "
                            "+0.0086, 95 % interval [+0.0084, +0.0088]")
    assert "(paired over 16 held-out sequences, 1600 tokens); p = 1.5e-05" in worse
