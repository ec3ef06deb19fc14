"""Options are checked before any model or data loads: typos are usage errors (exit 2) raised
before torch is imported, and impossible combinations or output locations are one error line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import pytest
from typer.testing import CliRunner

import fp8kv.calibrate.pipeline as pipeline
from fp8kv.checkpoint.conventions import CONVENTIONS
from fp8kv.checkpoint.load import MODEL_DTYPES
from fp8kv.kvdtypes import FP8_MAX, VLLM_KV_CACHE_DTYPE
from fp8kv.cli import app
from fp8kv.errors import ExitCode
from fp8kv.options import KvDtype, ModelDtype

TYPOS = [
    ["calibrate", "bundled", "--kv-dtype", "fp8_e4m33"],
    ["calibrate", "bundled", "--format", "modelop"],
    ["calibrate", "bundled", "--mode", "hardlink"],
    ["calibrate", "bundled", "--dtype", "bf16"],
    ["calibrate", "bundled", "--num-samples", "0"],
    ["calibrate", "bundled", "--headroom", "0.5"],
    ["verify", "bundled", "--device", "tpuu"],
    ["verify", "bundled", "--num-samples", "0"],
    ["convert", "bundled", "--to", "awq", "--out", "x"],
    ["calibrate", "bundled", "--strategy", "minmax"],
    ["calibrate", "bundled", "--strategy", "percentile:0"],
    ["calibrate", "bundled", "--headroom", "lots"],
    ["eval", "bundled", "--engines", "fast"],
    ["eval", "bundled", "--limit", "-3"],
    ["eval", "bundled", "--max-length", "0"],
]


@pytest.mark.parametrize("args", TYPOS, ids=lambda a: " ".join(a[2:4]))
def test_a_typo_is_a_usage_error_before_torch_loads(args):
    probe = ("import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [str(int(ExitCode.USAGE)), "False"], (proc.stdout, proc.stderr)
    assert f"Invalid value for '{args[2]}'" in proc.stderr


def test_help_lists_the_choices():
    text = CliRunner().invoke(app, ["calibrate", "--help"]).output
    assert "<" + "|".join(CONVENTIONS) + ">" in text
    assert "<fp8_e4m3|fp8_e5m2|fp8>" in text


def test_choice_lists_match_the_library():
    assert set(get_args(KvDtype)) == set(FP8_MAX)
    assert set(get_args(ModelDtype)) == {"auto", *MODEL_DTYPES}
    assert VLLM_KV_CACHE_DTYPE == {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}  # vLLM's --kv-cache-dtype


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer, data or model was loaded before the options were checked")

    for name in ("load_tokenizer", "load_calibration_data", "load_language_model"):
        monkeypatch.setattr(pipeline, name, refuse)


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-dtype", "fp8_e5m2"], "compressed-tensors stores fp8_e4m3 KV caches only"),
    (["--per-head", "--format", "modelopt"], "per-head (attn_head) scales can only be written as compressed-tensors"),
    (["--per-head", "--format", "vllm-json"], "per-head (attn_head) scales can only be written as compressed-tensors"),
])
def test_impossible_combinations_fail_before_anything_loads(nothing_loads, factory_checkpoint, tmp_path, extra, message):
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(tmp_path / "o"),
                                      *extra])
    assert result.exit_code == ExitCode.ERROR, result.output
    assert message in result.stderr
    assert not (tmp_path / "o").exists()


def test_unwritable_out_fails_before_anything_loads(nothing_loads, factory_checkpoint, tmp_path):
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out",
                                      str(tmp_path / "file" / "o")])
    assert result.exit_code == ExitCode.ERROR
    assert "file is not a folder" in result.stderr


def test_vllm_spelling_fp8_means_e4m3(factory_checkpoint, corpus, tmp_path):
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(out), "--dataset",
                                      corpus, "--num-samples", "2", "--seq-len", "16", "--kv-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "fp8kv.json").read_text())["kv_dtype"] == "fp8_e4m3"


def test_dash_h_is_help():
    for args in (["-h"], ["verify", "-h"], ["calibrate", "-h"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and "Usage: " in result.output


def test_verify_help_documents_the_exit_codes():
    text = " ".join(CliRunner().invoke(app, ["verify", "--help"]).output.split())
    assert "Exit codes: 0 PASS, 1 WARN, 2 USAGE, 3 FAIL, 4 ERROR, 5 CRASH." in text


def test_an_unexpected_exception_is_a_crash_never_warn(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr("fp8kv.verify.run.verify", broken)
    result = CliRunner().invoke(app, ["verify", "bundled"])
    assert result.exit_code == ExitCode.CRASH
    assert "fp8kv: internal error: KeyError: 'bug' (a bug in fp8kv; rerun with FP8KV_DEBUG=1" in result.stderr


@pytest.fixture(scope="module")
def quickstart_output(tmp_path_factory):
    """A calibrated bundled model, as the quickstart's first command leaves it."""
    out = tmp_path_factory.mktemp("fast") / "bundled-fp8kv"
    result = CliRunner().invoke(app, ["calibrate", "bundled", "--dataset", "bundled", "--num-samples", "4",
                                      "--seq-len", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    from tests.reports import report_for, write_report

    write_report(out, report_for(out))  # card and push check the report's digest against the folder
    return out


@pytest.mark.parametrize("command", [["--help"], ["verify", "--help"], ["eval", "--help"], ["card", "{out}"],
                                     ["push", "{out}", "--repo-id", "me/x", "--dry-run", "--force"],
                                     ["inspect", "{out}"], ["inspect", "{out}", "--json"]],
                         ids=lambda c: " ".join(c[:1] + c[2:]))
def test_reading_commands_import_no_torch(command, quickstart_output):
    """--help, card, push --dry-run and inspect of fp8kv's output read a few JSON files and the scale tensors'
    bytes (the attention geometry as fp8kv.json records it): they answer without importing torch."""
    probe = ("import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print('exit', exc.code or 0)\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    args = [part.format(out=quickstart_output) for part in command]
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "False False"], (proc.stdout, proc.stderr)


def test_the_requests_import_without_torch_or_lm_eval():
    """The command line reads its defaults from the requests before it knows whether torch is needed."""
    probe = ("import sys\nimport fp8kv.calibrate.request, fp8kv.verify.request, fp8kv.evaluation.request\n"
             "print(sorted(m for m in ('torch', 'transformers', 'lm_eval', 'datasets') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_help_shows_the_arguments_by_name():
    for command, argument in (("calibrate", "MODEL"), ("verify", "MODEL"), ("inspect", "MODEL"), ("eval", "DIR"),
                              ("card", "DIR"), ("push", "DIR")):
        usage = CliRunner().invoke(app, [command, "--help"], prog_name="fp8kv").stdout.splitlines()[0]
        assert usage == f"Usage: fp8kv {command} [OPTIONS] {argument}", usage


def test_inspect_takes_bundled_like_verify_and_eval():
    result = CliRunner().invoke(app, ["inspect", "bundled", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"].endswith("models/bundled/model")


def _probe(args: list[str], before: str = "") -> list[str]:
    """Run the console entry point in a fresh interpreter; return its last lines after the command."""
    probe = (f"import logging, os, sys\n{before}\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print('exit', exc.code or 0)\n"
             "print(os.environ.get('TRANSFORMERS_VERBOSITY'), logging.getLogger('lm_eval').level, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in __import__("os").environ.items() if k != "TRANSFORMERS_VERBOSITY"})
    return [*proc.stdout.splitlines()[-2:], proc.stderr]


def test_eval_without_its_extra_names_the_install_command():
    exit_line, state, stderr = _probe(["eval", "bundled"], before="sys.modules['lm_eval'] = None  # not installed")
    assert exit_line == f"exit {int(ExitCode.USAGE)}" and state.endswith("False")
    assert stderr == ('fp8kv: error: fp8kv eval needs lm-evaluation-harness: pip install "fp8kv[eval]" '
                      '(from a clone: pip install ".[eval]")\n')


def test_third_party_notes_are_quiet_unless_verbose(tmp_path):
    assert _probe(["card", str(tmp_path)])[1] == "error 40 False"  # TRANSFORMERS_VERBOSITY, logging.ERROR
    assert _probe(["-v", "card", str(tmp_path)])[1] == "None 0 False"


# Each command's driver, as the command imports it, and the options that are not fields of its request: how
# the output is shown, and verify's threshold overrides (folded into one `Thresholds` before the request).
DRIVERS = {"calibrate": "fp8kv.calibrate.pipeline.calibrate", "verify": "fp8kv.verify.run.verify",
           "eval": "fp8kv.evaluation.compare.evaluate"}
NOT_REQUEST_FIELDS = {
    "calibrate": {"json_output", "quiet"},
    "verify": {"json_output", "quiet", "thresholds_file", "max_kl_mean", "max_saturation", "unit_kl_ratio",
               "unit_ppl_ratio", "engine"},
    "eval": set(),
}


def _request_from_bare_command_line(command: str, monkeypatch) -> object:
    """The request `fp8kv COMMAND m` hands its driver, every option omitted (the driver is not run)."""
    import typer

    handed = []

    def driver(request, progress=None):
        handed.append(request)
        raise typer.Exit(0)

    monkeypatch.setattr(DRIVERS[command], driver)
    result = CliRunner().invoke(app, [command, "m"])
    assert result.exit_code == 0 and len(handed) == 1, result.output
    return handed[0]


@pytest.mark.parametrize("command", sorted(DRIVERS))
def test_command_line_defaults_are_the_requests(command, monkeypatch):
    """What a user gets by omitting every option is the request built with its own defaults, field by field
    (conversions included: `--headroom auto`, `--engine` and `--tasks` as text)."""
    from dataclasses import fields, replace
    from pathlib import Path

    import typer.main

    from fp8kv.calibrate.request import CalibrationRequest
    from fp8kv.evaluation.request import EvalRequest
    from fp8kv.verify.request import VerifyRequest
    from fp8kv.verify.verdict import load_thresholds

    handed = _request_from_bare_command_line(command, monkeypatch)
    if command == "calibrate":
        assert isinstance(handed, CalibrationRequest) and handed.command
        assert replace(handed, command=None) == CalibrationRequest(model="m")
    elif command == "verify":
        assert isinstance(handed, VerifyRequest) and handed.thresholds == load_thresholds()
        assert replace(handed, thresholds=None) == VerifyRequest(model_dir="m")
    else:
        assert handed == EvalRequest(model_dir=Path("m"))
    # Every option is a field of the request (so the comparison above covers its default) or named as not one.
    options = {param.name for param in typer.main.get_command(app).commands[command].params if not param.required}
    data = getattr(handed, "data", None)
    covered = {f.name for f in fields(handed)} | ({f.name for f in fields(data)} if data is not None else set())
    assert options - covered == NOT_REQUEST_FIELDS[command]
