"""Secrets and supply chain: a token in the environment never leaks, remote code is opt-in, and
commands write only inside their output folder and the system temp directory.

Every command runs as a real subprocess with `HF_TOKEN` set, HOME and the working directory
pointing at fresh empty folders, and TMPDIR at a folder of its own (the allowed scratch space).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fp8kv.calibrate.pipeline as pipeline_module
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint

TOKEN = "hf_fakeTOKEN1234567890abcdefSECRETxyz"


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Runs every command once with the token set; returns the folders and each command's output."""
    root = tmp_path_factory.mktemp("secrets")
    src = make_checkpoint("llama", root / "src")
    data = root / "data.jsonl"
    data.write_text("".join(f'{{"text": "held out and calibration sample {i}"}}\n' for i in range(4)))
    home, cwd, tmp, outs = root / "home", root / "cwd", root / "tmp", root / "outs"
    for folder in (home, cwd, tmp, outs):
        folder.mkdir()
    env = {**os.environ, "HF_TOKEN": TOKEN, "HOME": str(home), "TMPDIR": str(tmp), "PJRT_DEVICE": "CPU"}
    for key in ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "XDG_CACHE_HOME", "TRANSFORMERS_CACHE"):
        env.pop(key, None)
    before = {"src": SourceCheckpoint.open(src).content_hash(), "data": data.read_bytes()}
    out, converted = outs / "calibrated", outs / "converted"
    small = ["--num-samples", "2", "--seq-len", "16"]
    commands = {
        "calibrate": ["calibrate", str(src), "--dataset", str(data), *small, "--out", str(out)],
        "inspect": ["inspect", str(out), "--json"],
        "convert": ["convert", str(out), "--to", "modelopt", "--out", str(converted)],
        "verify": ["verify", str(out), "--dataset", str(data), *small, "--device", "cpu", "--num-prompts", "1",
                   "--prompt-len", "4", "--new-tokens", "2", "--batch-size", "2"],
        "card": ["card", str(out), "--repo-id", "org/model-fp8kv"],
        "push_dry_run": ["push", str(out), "--repo-id", "org/model-fp8kv", "--dry-run", "--force"],
        "error_calibrate": ["calibrate", str(root / "missing"), "--dataset", str(data), *small],
        "error_push": ["push", str(out), "--repo-id", "bad id!", "--dry-run"],
        "error_verify": ["verify", str(root / "missing"), "--device", "cpu"],
    }
    results = {}
    for name, args in commands.items():
        results[name] = subprocess.run([sys.executable, "-m", "fp8kv", *args], cwd=cwd, env=env,
                                       capture_output=True, text=True, timeout=300)
    return {"root": root, "src": src, "data": data, "home": home, "cwd": cwd, "tmp": tmp, "outs": outs,
            "before": before, "results": results}


def test_every_command_ran(session):
    codes = {name: r.returncode for name, r in session["results"].items()}
    assert codes["calibrate"] == 0 and codes["inspect"] == 0 and codes["convert"] == 0, session["results"]
    assert codes["card"] == 0 and codes["push_dry_run"] == 0
    assert codes["verify"] in (0, 1), session["results"]["verify"].stderr
    assert codes["error_calibrate"] == 4 and codes["error_push"] == 2 and codes["error_verify"] == 4


def test_token_never_printed(session):
    for name, result in session["results"].items():
        assert TOKEN not in result.stdout and TOKEN not in result.stderr, name
        assert TOKEN[3:15] not in result.stdout + result.stderr, name  # nor a recognisable part of it


def test_token_never_written(session):
    for path, content in files_under(session["root"]).items():
        assert TOKEN.encode() not in content, path


def test_writes_stay_in_the_output_folder_and_temp(session):
    assert files_under(session["home"]) == {} and not list(session["home"].iterdir()), \
        sorted(p.as_posix() for p in session["home"].rglob("*"))
    assert not list(session["cwd"].iterdir()), sorted(p.as_posix() for p in session["cwd"].rglob("*"))
    allowed = {"src", "data.jsonl", "home", "cwd", "tmp", "outs"}
    assert {p.name for p in session["root"].iterdir()} == allowed
    assert {p.name for p in session["outs"].iterdir()} == {"calibrated", "converted"}
    assert SourceCheckpoint.open(session["src"]).content_hash() == session["before"]["src"]
    assert session["data"].read_bytes() == session["before"]["data"]


def test_trust_remote_code_is_off_by_default_and_explained(monkeypatch):
    seen = []

    def capture(request, progress=None):
        seen.append(request.trust_remote_code)
        raise Fp8kvError("stop here")

    monkeypatch.setattr(pipeline_module, "calibrate", capture)
    runner = CliRunner()
    assert runner.invoke(app, ["calibrate", "somewhere"]).exit_code == 4
    assert runner.invoke(app, ["calibrate", "somewhere", "--trust-remote-code"]).exit_code == 4
    assert seen == [False, True]
    help_text = " ".join(runner.invoke(app, ["calibrate", "--help"]).output.replace("│", " ").split())
    assert "--trust-remote-code" in help_text
    assert "Run Python code shipped inside the checkpoint" in help_text
    assert "Only for checkpoints you trust" in help_text
