"""`fp8kv calibrate` through typer's runner: options reach the library, JSON stays clean."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fp8kv.options import DEFAULT_HEADROOM
from fp8kv.cli import app
from fp8kv.tools.factory import make_checkpoint


def test_calibrate_json_summary_and_provenance(tmp_path):
    src = make_checkpoint("qwen3", tmp_path / "src")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of calibration text"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    args = ["calibrate", str(src), "--out", str(out), "--dataset", str(data), "--num-samples", "4",
            "--seq-len", "16", "--batch-size", "2", "--seed", "3", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out)
    assert summary["dataset"] == {
        "name": str(data), "split": "train", "text_column": "text", "num_samples": 4,
        "num_tokens": summary["dataset"]["num_tokens"], "seq_len": 16, "seed": 3, "note": None,
        "sample_digests": summary["dataset"]["sample_digests"],
    }
    assert len(set(summary["dataset"]["sample_digests"])) == 4  # one per record, which all differ
    assert [row["layer"] for row in summary["layers"]] == [0, 1]
    keys = {"layer", "headroom", "k_amax", "v_amax", "k_clip", "v_clip", "k_scale", "v_scale", "k_saturation",
            "v_saturation", "k_amax_per_head", "v_amax_per_head"}
    assert set(summary["layers"][0]) == keys
    written = json.loads((out / "fp8kv.json").read_text())
    assert written["layers"] == summary["layers"] and written["strategy"] == "amax"
    assert written["kv_dtype"] == "fp8_e4m3" and written["headroom"] == DEFAULT_HEADROOM


def test_calibrate_table_and_refusals(tmp_path):
    src = make_checkpoint("llama", tmp_path / "src")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "only one record"}) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["calibrate", str(src), "--dataset", str(data), "--num-samples", "1"])
    assert ok.exit_code == 0, ok.output
    assert "k_scale" in ok.stdout and "v_scale" in ok.stdout
    bad = runner.invoke(app, ["calibrate", str(src), "--dataset", str(data), "--num-samples", "1", "--strategy", "p99"])
    assert bad.exit_code != 0
    assert "use amax, mse, last-batch, or percentile:P" in (bad.output + str(bad.exception))
