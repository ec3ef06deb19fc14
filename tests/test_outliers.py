"""The bundled outlier model: rebuilt byte for byte, the same logits as the bundled model, K/V at or beyond 448."""

from __future__ import annotations

import json

import torch

from fp8kv.data import DataRequest
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_DIR
from fp8kv.tools.outliers import OUTLIERS, build


def test_the_committed_files_are_what_the_script_builds(tmp_path):
    out = build(out=tmp_path / "outliers")
    committed = sorted(p.name for p in BUNDLED_OUTLIERS_DIR.iterdir())
    assert sorted(p.name for p in out.iterdir()) == committed
    for name in committed:
        assert (out / name).read_bytes() == (BUNDLED_OUTLIERS_DIR / name).read_bytes(), name
    assert resolve_model("bundled-outliers") == BUNDLED_OUTLIERS_DIR


def test_same_logits_as_the_bundled_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    text = json.loads(BUNDLED_HELDOUT_TEXT.read_text().splitlines()[0])["text"]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :96]
    logits = []
    for path in (BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_DIR):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])  # powers of two: exact in bf16, not merely close


def test_outlier_layers_have_amax_beyond_e4m3_and_the_others_do_not():
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=8, seq_len=128)
    plain = calibrate(CalibrationRequest(model="bundled", data=data, headroom=1.0)).table.amax.amax(-1)
    table = calibrate(CalibrationRequest(model="bundled-outliers", data=data, headroom=1.0)).table
    amax = table.amax.amax(-1)  # [layers, 2]
    moved = {(o.layer, 0 if o.kind == "k" else 1) for o in OUTLIERS}
    assert amax.max() > 2 * 448
    for layer in range(4):
        for kind in (0, 1):
            if (layer, kind) in moved:  # layer 3's K sits at the limit on little text and past it on more
                assert amax[layer, kind] >= 448, (layer, kind)
            else:
                assert amax[layer, kind] == plain[layer, kind] < 448, (layer, kind)
