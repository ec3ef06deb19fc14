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
                                     ["push", "{out}", "--repo-id", "me/x", "--dry-run", "--force"]],
                         ids=lambda c: " ".join(c[:1] + c[2:]))
def test_reading_commands_import_no_torch(command, quickstart_output):
    """--help, card and push --dry-run read a few JSON files: they answer without importing torch."""
    probe = ("import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print('exit', exc.code or 0)\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    args = [part.format(out=quickstart_output) for part in command]
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "False False"], (proc.stdout, proc.stderr)


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


def _cli_defaults(command: str) -> dict[str, object]:
    """Each option of `command` (its parameter name) -> the default the command line gives it."""
    import typer.main

    click_command = typer.main.get_command(app).commands[command]
    return {param.name: param.default for param in click_command.params if not param.required}


@pytest.mark.parametrize("command", ["calibrate", "verify", "eval"])
def test_command_line_defaults_are_the_requests(command):
    """What a user gets by omitting an option is what the library does by default."""
    from dataclasses import MISSING, fields

    from fp8kv.calibrate.request import CalibrationRequest
    from fp8kv.evaluation.compare import EvalRequest
    from fp8kv.options import DEFAULT_HEADROOM
    from fp8kv.verify.run import VerifyRequest

    request = {"calibrate": CalibrationRequest(model="m"), "verify": VerifyRequest(model_dir="m"),
               "eval": EvalRequest(model_dir="m", tasks=())}[command]
    cli = _cli_defaults(command)
    shared = {f.name for f in fields(request) if f.default is not MISSING or f.default_factory is not MISSING} & set(cli)
    assert len(shared) >= 4, shared
    as_cli = {"engines": ",".join(getattr(request, "engines", ())), "kv_dtype": getattr(request, "kv_dtype", None)}
    for name in shared - {"headroom"}:  # "auto" on the command line; checked below
        expected = as_cli.get(name, getattr(request, name))
        if name == "engines" and command == "verify":
            expected = "all"
        assert cli[name] == expected, (command, name, cli[name], expected)
    data = getattr(request, "data", None)
    if data is not None:
        assert {k: cli[k] for k in ("num_samples", "seq_len", "seed")} == \
            {"num_samples": data.num_samples, "seq_len": data.seq_len, "seed": data.seed}
    if command == "calibrate":
        assert cli["headroom"] == "auto" and request.headroom == DEFAULT_HEADROOM
