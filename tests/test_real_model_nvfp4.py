"""bench/real_model.py --kv-dtype nvfp4 on the bundled model: the NVFP4 table has a row for bf16, fp8, each NVFP4
cache at global scale 1.0, every engine path verify runs (at the scale its loader holds), and an amax / 2688 file on
exactly the paths whose fp8 read it overflows."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8kv.checkpoint.nvfp4 import MODELOPT_PRE_042
from fp8kv.data import DataRequest, load_calibration_data
from fp8kv.evaluation.bundled_tasks import arithmetic_items
from fp8kv.serving import nvfp4_traits_of
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR
from fp8kv.verify.nvfp4 import BOUND, nvfp4_paths, runs_divisor

BENCH = Path(__file__).parents[1] / "bench"


def test_the_nvfp4_table_has_a_row_per_engine_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its neighbours as top-level modules
    import kvcompare
    import real_model

    model = kvcompare.Model.open(BUNDLED_MODEL_DIR)
    ask = lambda path, n: DataRequest(str(path), num_samples=n, seq_len=48, seed=42)  # noqa: E731
    calib = load_calibration_data(ask(BUNDLED_CALIBRATION_TEXT, 2), model.tokenizer)
    held = load_calibration_data(ask(BUNDLED_HELDOUT_TEXT, 2), model.tokenizer).samples
    rows = real_model.nvfp4_table(model, calib, held, arithmetic_items()[:2])

    assert [(r["cache"], r["engine"]) for r in rows[:2]] == [("bf16", "-"), ("fp8_e4m3", real_model.DEFAULT_ENGINE)]
    assert rows[0]["kl_mean"] == 0.0
    paths = nvfp4_paths("nvfp4", nvfp4_traits_of(BUNDLED_MODEL_DIR))
    unit = [r for r in rows if r["scales"].startswith("global 1.0")]
    assert {r["cache"] for r in unit} == {f"{p.cache}, {p.read} read" for p in paths}
    calibrated = [r for r in rows if r["scales"].startswith("calibrated") and r["cache"] != "fp8_e4m3"]
    stored_2688 = [r for r in rows if r["scales"].startswith("stored")]
    assert len(rows) == 2 + len(unit) + len(calibrated) + len(stored_2688)
    for path in paths:
        # each path is on one calibrated row, or on its cache's unit row where it does not load the scales
        home = [r for r in (calibrated if path.loads else unit) if path.name in r["engine"].split("; ")
                or f"{path.name} (does not load them)" in r["engine"].split("; ")]
        assert len(home) == 1 and home[0]["cache"] == f"{path.cache}, {path.read} read", path.name
        if path.loads:
            assert home[0]["scales"].endswith(f"/ {runs_divisor(path, real_model.MODELOPT):g}"
                                              + ("" if path.factor == 1.0 else f" (x{path.factor:g})"))
        overflows = path.read == "fp8" and runs_divisor(path, MODELOPT_PRE_042) > BOUND
        assert any(path.name in r["engine"].split("; ") for r in stored_2688) == overflows, path.name
    assert stored_2688 and all(r["cache"].endswith("fp8 read") for r in stored_2688)
    assert all(r["sequences"] == len(held) and 0.0 <= r["task_accuracy"] <= 1.0 for r in rows)
