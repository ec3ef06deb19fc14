"""The first run works as the README says: offline, from any folder, with progress a log can read."""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import fp8kv
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
    assert data.note == (f"the bundled corpus has {BUNDLED_RECORDS} records, fewer than the 512 samples asked for; "
                         f"all {BUNDLED_RECORDS} are used")


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
    assert "so the scales are calibrated on the bundled model's own corpus of Python documentation" in text
    assert f"fewer than the 512 samples asked for; all {BUNDLED_RECORDS} are used" in text


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


def _readme_quickstart() -> list[list[str]]:
    """The commands of README's first Quickstart block, one argv per line."""
    readme = (Path(fp8kv.__file__).parent / "README.md").read_text()
    section = readme[readme.index("## Quickstart"):]
    block = section[section.index("```sh\n") + len("```sh\n"):section.index("```", section.index("```sh\n") + 5)]
    return [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]


def test_readme_quickstart_runs_offline_from_another_folder(tmp_path):
    """Every command of README's quickstart, as typed, in an empty folder outside the repository."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PJRT_DEVICE": "CPU"}
    commands = _readme_quickstart()
    assert [argv[:2] for argv in commands] == [["fp8kv", "calibrate"], ["fp8kv", "verify"], ["fp8kv", "inspect"],
                                               ["fp8kv", "card"], ["fp8kv", "push"]]
    for argv in commands:
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    out = tmp_path / "bundled-fp8kv"
    assert (out / "fp8kv.json").is_file() and (out / "verify" / "report.json").is_file()
    assert "you/bundled-fp8kv" in (out / "README.md").read_text()
    assert "README.md" in proc.stdout and "kv_scales.safetensors" in proc.stdout  # push --dry-run lists the files


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
