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
from fp8kv.options import (
    KV_DTYPE_SPELLINGS, KvDtype, KvDtypeSpelling, ModelDtype, Nvfp4KvDtype, RuntimeChoice, TorchDeviceChoice,
)

TYPOS = [
    ["calibrate", "bundled", "--kv-dtype", "fp8_e4m33"],
    ["calibrate", "bundled", "--format", "modelop"],
    ["calibrate", "bundled", "--mode", "hardlink"],
    ["calibrate", "bundled", "--dtype", "bf16"],
    ["calibrate", "bundled", "--num-samples", "0"],
    ["calibrate", "bundled", "--headroom", "0.5"],
    ["verify", "bundled", "--device", "tpuu"],
    ["verify", "bundled", "--num-samples", "0"],
    ["convert", "bundled", "--out", "x", "--to", "awq"],
    ["calibrate", "bundled", "--strategy", "minmax"],
    ["calibrate", "bundled", "--strategy", "percentile:0"],
    ["calibrate", "bundled", "--headroom", "lots"],
    ["eval", "bundled", "--engines", "fast"],
    ["eval", "bundled", "--limit", "-3"],
    ["eval", "bundled", "--max-length", "0"],
    ["verify", "bundled", "--engine", "vllm-cuda,fast"],
    ["verify", "bundled", "--max-kl-mean", "nan"],
    ["verify", "bundled", "--false-alarm-rate", "-1"],
    ["conformance", "simulate", "PACK", "--out", "x", "--bug", "raw"],
    ["conformance", "reference", "DIR", "--out", "PACK", "--scale-factor", "2"],
    ["conformance", "reference", "DIR", "--out", "PACK", "--mode", "hardlink"],
    ["conformance", "simulate", "PACK", "--bug", "correct", "--out", "x", "--device", "gpu"],
    ["push", "DIR", "--dry-run", "--repo-id", "not a/valid/id"],
    ["card", "DIR", "--base-model", "/local/path"],
    ["calibrate", "bundled", "--base-model", "tiny"],
]
# Command lines typer itself refuses: an argument or a required option missing, an option unknown.
MALFORMED = [["inspect"], ["inspect", "bundled", "--jsn"], ["card"], ["card", "DIR", "--forse"], ["push", "DIR"],
             ["push", "DIR", "--repo-id", "me/x", "--dryrun"], ["convert", "DIR", "--out", "x"],
             ["conformance", "check", "PACK"], ["eval"], ["verify"], ["calibrate"]]


def _exit_and_torch(args: list[str]) -> tuple[list[str], str]:
    """Run the console entry point on `args` in a fresh interpreter: its exit code and whether torch was imported
    (as printed), and its stderr."""
    probe = ("import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    return proc.stdout.split(), proc.stderr


def _option(args: list[str]) -> str:
    """The option a typo's command line gets wrong: its last."""
    return [a for a in args if a.startswith("--")][-1]


@pytest.mark.parametrize("args", TYPOS, ids=lambda a: " ".join([a[0], _option(a)]))
def test_a_typo_is_a_usage_error_before_torch_loads(args):
    state, stderr = _exit_and_torch(args)
    assert state == [str(int(ExitCode.USAGE)), "False"], (state, stderr)
    assert f"Invalid value for '{_option(args)}'" in stderr
    assert "Value error" not in stderr, stderr


def test_verify_needs_two_tokens_a_sample_before_torch_loads():
    state, stderr = _exit_and_torch(["verify", "bundled", "--seq-len", "1"])
    assert state == [str(int(ExitCode.USAGE)), "False"], (state, stderr)
    assert stderr == ("fp8kv: error: --seq-len must be at least 2 for verify (perplexity scores every token after "
                      "the first), got 1\n")


@pytest.mark.parametrize("args", MALFORMED, ids=" ".join)
def test_a_malformed_command_line_is_a_usage_error_before_torch_loads(args):
    state, stderr = _exit_and_torch(args)
    assert state == [str(int(ExitCode.USAGE)), "False"], (state, stderr)
    assert stderr.startswith("Usage: ") and "Error: " in stderr, stderr


def test_eval_refuses_to_write_into_a_foreign_folder_before_torch_loads(tmp_path):
    state, stderr = _exit_and_torch(["eval", str(tmp_path)])
    assert state == [str(int(ExitCode.ERROR)), "False"], (state, stderr)
    assert stderr.startswith(f"fp8kv: error: {tmp_path}: not written by fp8kv (no fp8kv.json); pass --report FOLDER")


@pytest.mark.parametrize(("option", "name", "message"), [
    ("--thresholds", "t.toml", "{path}: [fail] kl_mean = -1 must be a number >= 0"),
    ("--prompts", "folder", "{path}: is a folder; --prompts takes a text file, one prompt per line"),
    ("--prompts", "missing.txt", "{path}: no such prompts file (one prompt per line)"),
])
def test_verify_refuses_a_bad_file_option_before_torch_loads(tmp_path, option, name, message):
    (tmp_path / "t.toml").write_text("[fail]\nkl_mean = -1\n")
    (tmp_path / "folder").mkdir()
    path = tmp_path / name
    state, stderr = _exit_and_torch(["verify", "bundled", option, str(path)])
    assert state == [str(int(ExitCode.ERROR)), "False"], (state, stderr)
    assert stderr == f"fp8kv: error: {message.format(path=path)}\n"


def test_help_lists_the_choices():
    text = CliRunner().invoke(app, ["calibrate", "--help"]).output
    assert "<" + "|".join(CONVENTIONS) + ">" in text
    assert "<fp8_e4m3|fp8_e5m2|fp8|nvfp4|fp8_k_nvfp4_v>" in text


def test_choice_lists_match_the_library():
    assert set(get_args(KvDtype)) == set(FP8_MAX)
    assert set(get_args(ModelDtype)) == {"auto", *MODEL_DTYPES}
    assert set(get_args(KvDtypeSpelling)) == (  # --kv-dtype
        set(get_args(KvDtype)) | set(KV_DTYPE_SPELLINGS) | set(get_args(Nvfp4KvDtype)))
    assert set(get_args(TorchDeviceChoice)) < set(get_args(RuntimeChoice))  # calibrate's --device, verify's
    assert VLLM_KV_CACHE_DTYPE == {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}  # vLLM's --kv-cache-dtype


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-dtype", "fp8_e5m2"], "compressed-tensors stores fp8_e4m3 KV caches only"),
    (["--per-head", "--format", "modelopt"], "per-head (attn_head) scales can only be written as compressed-tensors"),
    (["--per-head", "--format", "vllm-json"], "per-head (attn_head) scales can only be written as compressed-tensors"),
    (["--attention", "fp8", "--format", "quark"], "--attention fp8 writes q_scale, which only the compressed-tensors"),
])
def test_impossible_combinations_fail_before_torch_loads(factory_checkpoint, tmp_path, extra, message):
    state, stderr = _exit_and_torch(["calibrate", str(factory_checkpoint("llama")), "--out", str(tmp_path / "o"),
                                     *extra])
    assert state == [str(int(ExitCode.ERROR)), "False"], (state, stderr)
    assert stderr.startswith("fp8kv: error: ") and message in stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer, data or model was loaded before the options were checked")

    for name in ("load_tokenizer", "load_calibration_data", "load_language_model"):
        monkeypatch.setattr(pipeline, name, refuse)


@pytest.mark.parametrize("options", [{"kv_dtype": "fp8_e5m2"}, {"per_head": True, "convention": "modelopt"},
                                     {"attention": "fp8", "convention": "quark"}, {"base_model": "tiny"},
                                     {"out": "file/o"}], ids=lambda o: ",".join(o))
def test_the_library_refuses_what_the_command_line_does_before_anything_loads(nothing_loads, factory_checkpoint,
                                                                               tmp_path, options):
    """`calibrate()` called directly runs the same checks (the command line runs them before torch loads)."""
    from fp8kv.calibrate.request import CalibrationRequest
    from fp8kv.errors import Fp8kvError

    (tmp_path / "file").write_text("x")
    out = tmp_path / options.pop("out", "o")
    with pytest.raises(Fp8kvError):
        pipeline.calibrate(CalibrationRequest(model=str(factory_checkpoint("llama")), out=out, **options))
    assert not (tmp_path / "o").exists()


def test_unwritable_out_fails_before_torch_loads(factory_checkpoint, tmp_path):
    (tmp_path / "file").write_text("x")
    state, stderr = _exit_and_torch(["calibrate", str(factory_checkpoint("llama")), "--out", str(tmp_path / "file" / "o")])
    assert state == [str(int(ExitCode.ERROR)), "False"], (state, stderr)
    assert stderr == f"fp8kv: error: {tmp_path / 'file' / 'o'}: cannot create the output folder ({tmp_path / 'file'} is not a folder)\n"


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


@pytest.mark.parametrize("command", [["--help"], ["--version"], *([name, "--help"] for name in (
    "calibrate", "verify", "eval", "inspect", "convert", "card", "push", "conformance")),
    *(["conformance", name, "--help"] for name in ("reference", "check", "simulate")), ["card", "{out}"],
    ["push", "{out}", "--repo-id", "me/x", "--dry-run", "--force"], ["inspect", "{out}"], ["inspect", "{out}", "--json"]],
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
                              ("card", "DIR"), ("push", "DIR"), ("convert", "DIR"),
                              ("conformance reference", "DIR"), ("conformance simulate", "PACK"),
                              ("conformance check", "PACK ENGINE.jsonl")):
        usage = CliRunner().invoke(app, [*command.split(), "--help"], prog_name="fp8kv").stdout.splitlines()[0]
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


# Each command that hands a request to its driver: the shortest command line it accepts, the driver as the command
# imports it, and the options that are no field of the request: how the output is shown, verify's threshold
# overrides (folded into one `Thresholds`) and its --engine text (parsed into `engines`).
BARE_COMMANDS = {
    "calibrate": (["calibrate", "m"], "fp8kv.calibrate.pipeline.calibrate", {"json_output", "quiet"}),
    "verify": (["verify", "m"], "fp8kv.verify.run.verify",
               {"json_output", "quiet", "thresholds_file", "max_kl_mean", "max_saturation", "unit_kl_ratio",
                "false_alarm_rate", "engine"}),
    "eval": (["eval", "m"], "fp8kv.evaluation.compare.evaluate", set()),
    "conformance reference": (["conformance", "reference", "m", "--out", "p"], "fp8kv.conformance.run.reference",
                              set()),
    "conformance simulate": (["conformance", "simulate", "p", "--bug", "correct", "--out", "x"],
                             "fp8kv.conformance.run.simulate", set()),
}


def _handed_request(command: str, monkeypatch, tmp_path) -> object:
    """The request `command`'s shortest command line hands its driver (the driver is not run), run where `m` is a
    folder fp8kv wrote (eval writes its results into such a folder by default)."""
    import typer

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "fp8kv.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    args, driver_path, _ = BARE_COMMANDS[command]
    handed = []

    def driver(request, progress=None):
        handed.append(request)
        raise typer.Exit(0)

    monkeypatch.setattr(driver_path, driver)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and len(handed) == 1, result.output
    return handed[0]


@pytest.mark.parametrize("command", list(BARE_COMMANDS))
def test_command_line_defaults_are_the_requests(command, monkeypatch, tmp_path):
    """What a user gets by omitting every option is the request built with its own defaults, field by field
    (conversions included: `--headroom auto`, `--engine` and `--tasks` as text)."""
    from dataclasses import fields
    from pathlib import Path

    import typer.main

    from fp8kv.calibrate.request import CalibrationRequest
    from fp8kv.conformance.request import ReferenceRequest, SimulateRequest
    from fp8kv.evaluation.request import EvalRequest
    from fp8kv.verify.request import VerifyRequest
    from fp8kv.verify.verdict import load_thresholds

    handed = _handed_request(command, monkeypatch, tmp_path)
    if isinstance(handed, CalibrationRequest):
        assert handed.command  # the command line, recorded in fp8kv.json
    expected = {
        "calibrate": lambda: CalibrationRequest(model="m", command=getattr(handed, "command", None)),
        "verify": lambda: VerifyRequest(model_dir="m", thresholds=load_thresholds()),  # configs/verify.toml
        "eval": lambda: EvalRequest(model_dir=Path("m")),
        "conformance reference": lambda: ReferenceRequest(Path("m"), Path("p")),
        "conformance simulate": lambda: SimulateRequest(Path("p"), "correct", Path("x")),
    }[command]()
    assert handed == expected
    # Every option is a field of the request (so the comparison above covers its default) or named as not one.
    click_command = typer.main.get_command(app)
    for word in command.split():
        click_command = click_command.commands[word]
    options = {param.name for param in click_command.params if not param.required}
    data = getattr(handed, "data", None)
    covered = {f.name for f in fields(handed)} | ({f.name for f in fields(data)} if data is not None else set())
    assert options - covered == BARE_COMMANDS[command][2]


def test_convert_defaults_are_the_library_function_s():
    """convert has no request: its options' defaults are `convert_checkpoint`'s keyword defaults."""
    import inspect

    import typer.main

    from fp8kv.checkpoint.convert import convert_checkpoint

    keywords = {name: p.default for name, p in inspect.signature(convert_checkpoint).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "command"}
    options = {p.name: p.default for p in typer.main.get_command(app).commands["convert"].params if not p.required}
    assert options == keywords == {"overwrite": False, "mode": "overlay", "source_convention": None}
