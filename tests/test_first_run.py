"""The first run works as the README says: offline, from any folder, with progress a log can read."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp8kv.data as data_module
import fp8kv.calibrate.pipeline as pipeline
from fp8kv.data import DataRequest, load_calibration_data
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.data import load_tokenizer
from fp8kv.errors import Fp8kvError
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_MODEL_DIR
from fp8kv.progress import StageProgress

BUNDLED_RECORDS = sum(1 for line in BUNDLED_CALIBRATION_TEXT.read_text().splitlines() if line.strip())
STAMP = re.compile(r"^\d\d:\d\d:\d\d fp8kv: ")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL_DIR, False)


def test_dataset_bundled_names_the_bundled_split_and_uses_all_of_it(tokenizer):
    data = load_calibration_data(DataRequest(dataset="bundled", num_samples=512, seq_len=8), tokenizer)
    assert len(data.samples) == BUNDLED_RECORDS
    assert data.note == f"the bundled corpus has {BUNDLED_RECORDS} records; using all {BUNDLED_RECORDS} (--num-samples 512)"


@pytest.mark.parametrize("name", ["data/calib.jsonl", "./corpus", "~/texts/a.txt", "a/b/c"])
def test_a_missing_path_is_never_looked_up_on_the_hub(tokenizer, monkeypatch, name):
    monkeypatch.setattr(data_module, "_load_named", lambda *a: pytest.fail("looked up as a Hub dataset"))
    with pytest.raises(Fp8kvError, match=f"^{re.escape(name)}: no such file or folder"):
        load_calibration_data(DataRequest(dataset=name), tokenizer)


def test_fallback_is_announced_before_the_work(monkeypatch, tmp_path):
    monkeypatch.setattr(data_module, "_hub_reachable", lambda: False)
    stream = io.StringIO()
    real_observe = pipeline.observe_whole_model

    def observe(*args, **kwargs):
        stream.write("OBSERVING\n")
        return real_observe(*args, **kwargs)

    monkeypatch.setattr(pipeline, "observe_whole_model", observe)
    request = CalibrationRequest(model="bundled", data=DataRequest(seq_len=8), device="cpu", out=tmp_path / "o")
    with StageProgress(stream=stream) as progress:
        calibrate(request, progress=progress)
    text = stream.getvalue()
    note = text.index("fp8kv: HuggingFaceH4/ultrachat_200k cannot be loaded (offline and not cached)")
    assert note < text.index("OBSERVING")
    assert "for a real model they would reflect the wrong text; pass --dataset" in text
    assert f"using all {BUNDLED_RECORDS} (--num-samples 512)" in text


def test_plain_progress_is_timestamped_per_stage_and_quiet_keeps_notes():
    stream = io.StringIO()
    with StageProgress(stream=stream, interval_s=0) as progress:
        progress("loading")
        progress("observing", 1, 4)
        progress("observing", 4, 4)
        progress.note("a note")
    lines = stream.getvalue().splitlines()
    assert [STAMP.sub("", line) for line in lines if STAMP.match(line)] == [
        "loading", "observing: 1/4", "observing: 4/4 (0 s)"]
    assert "fp8kv: a note" in lines
    quiet = io.StringIO()
    with StageProgress(quiet=True, stream=quiet) as progress:
        progress("loading")
        progress.note("still shown")
    assert quiet.getvalue() == "fp8kv: still shown\n"


def test_readme_quickstart_runs_offline_from_another_folder(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PJRT_DEVICE": "CPU"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fp8kv", "calibrate", "bundled", "--dataset", "bundled",
                           "--num-samples", "8", "--seq-len", "32", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"next: fp8kv verify {out}" in proc.stdout
    stages = [line for line in proc.stderr.splitlines() if STAMP.match(line)]
    assert any("observing K/V over 8 samples" in line for line in stages), proc.stderr
    assert (out / "fp8kv.json").is_file()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_terminal_every_stage_shows_with_counts_and_eta():
    stream = _Terminal()
    with StageProgress(stream=stream) as progress:
        progress("loading the model")
        progress("observing K/V (samples)", 3, 8)
        progress("comparing caches (samples)", 8, 8)
    text = stream.getvalue()
    for shown in ("loading the model", "observing K/V (samples)", "3/8", "comparing caches (samples)", "8/8", "ETA"):
        assert shown in text, text
