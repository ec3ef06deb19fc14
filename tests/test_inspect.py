"""`fp8kv inspect` and `fp8kv convert` through the real typer app."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8kv.checks import FAIL, check_readout
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.provenance import CacheRecord, LayerRecord, Provenance
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.cli import app
from fp8kv.inspection import InspectReport
from fp8kv.tools.factory import make_checkpoint
from fp8kv.verify.static import static_checks
from tests.test_interop_conventions import golden

runner = CliRunner()


def _provenance(rows: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]) -> Provenance:
    """fp8kv.json with layer -> ((k amax, k scale, k saturation), (v amax, v scale, v saturation))."""
    def cache(amax: float, scale: float, saturation: float) -> CacheRecord:
        return CacheRecord(amax=amax, clip=amax, scale=scale, saturation=saturation, amax_per_head=(amax,))

    layers = tuple(LayerRecord(layer, 1.0, cache(*k), cache(*v)) for layer, (k, v) in rows.items())
    record = Provenance(version="0.1.0", command=None, format="compressed-tensors", layers=layers)
    return record


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("base") / "qwen3", num_kv_heads=1, num_heads=2)


def _inspect(path: Path) -> dict:
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt", "quark", "vllm-json"])
def test_inspect_names_the_convention_and_layer_scales(llama, tmp_path, convention):
    report = _inspect(golden(llama, tmp_path / "g", convention))
    assert report["conventions"] == [convention]
    assert report["kv_dtype"] == "fp8_e4m3" and report["strategy"] == "tensor"
    assert [row["layer"] for row in report["layers"]] == [0, 1]
    expected_k = [0.0625, 0.125] if convention == "vllm-json" else [0.015625, 0.03125]
    assert [row["k_scale"] for row in report["layers"]] == expected_k
    vllm_note = any("--quantization-param-path" in w for w in report["warnings"])
    assert vllm_note == (convention == "vllm-json")


def test_inspect_table_shows_amax_and_saturation_from_provenance(llama, tmp_path):
    provenance = _provenance({i: ((4.48 * (i + 1), 0.01 * (i + 1), 0.0), (8.96, 0.02, 0.001)) for i in (0, 1)})
    out = write_checkpoint(llama, tmp_path / "out", KVScales.from_floats({0: 0.01, 1: 0.02}, {0: 0.02, 1: 0.02}),
                           record=provenance)
    report = _inspect(out)
    assert report["layers"][1] == {"layer": 1, "k_scale": pytest.approx(0.02), "v_scale": pytest.approx(0.02),
                                   "k_amax": 8.96, "v_amax": 8.96, "k_saturation": 0.0, "v_saturation": 0.001}
    assert report["warnings"] == []
    text = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "K amax" in text and "V saturation" in text and "8.96" in text and "0.1 %" in text


def test_inspect_warns_on_each_suspicious_pattern(llama, qwen3, tmp_path):
    ones = write_checkpoint(llama, tmp_path / "ones", KVScales.from_floats({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}))
    assert "every scale is 1.0: the checkpoint is likely uncalibrated" in _inspect(ones)["warnings"]

    bad = shutil.copytree(ones, tmp_path / "bad")
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.0]),
               "model.layers.0.self_attn.v_scale": torch.tensor([float("nan")])}, bad / "kv_scales.safetensors")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "layers.1.self_attn.k_scale" not in k
                           and "layers.1.self_attn.v_scale" not in k}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    warnings = _inspect(bad)["warnings"]
    assert "layer 0: k_scale 0.0 is not a positive finite number" in warnings
    assert "layer 0: v_scale nan is not a positive finite number" in warnings
    assert any(w.startswith("layers [1] own a KV cache but have no K and V scales") for w in warnings)

    pre_rope = golden(qwen3, tmp_path / "quark", "quark")
    warnings = _inspect(pre_rope)["warnings"]
    assert any(w.startswith("quark scales observe k_proj's output, but this model has a k norm") for w in warnings)
    assert any(w.startswith("num_key_value_heads=1: torch_xla 2.9's Pallas kernel (vLLM's torch_xla TPU backend) needs") for w in warnings)

    doubled = _provenance({i: ((2.24, 0.01, 0.0), (2.24, 0.01, 0.0)) for i in (0, 1)})
    fnuz = write_checkpoint(llama, tmp_path / "fnuz", KVScales.from_floats({0: 0.01, 1: 0.01}, {0: 0.01, 1: 0.01}),
                            record=doubled)
    assert any("doubled for e4m3fnuz" in w for w in _inspect(fnuz)["warnings"])
    assert not any("differs from what fp8kv calibrate recorded" in w for w in _inspect(fnuz)["warnings"])

    # the scale file edited after calibration: fp8kv.json's amax and saturation describe other scales
    edited = write_checkpoint(llama, tmp_path / "edited", KVScales.from_floats({0: 0.01, 1: 0.03}, {0: 0.01, 1: 0.01}),
                              record=doubled)
    assert ("the scale file differs from what fp8kv calibrate recorded in fp8kv.json (layer 1 k_scale 0.03, recorded "
            "0.01): it was changed after calibration, so fp8kv.json's amax and saturation describe other scales; "
            "recalibrate, or verify these as they are") in _inspect(edited)["warnings"]

    undeclared = shutil.copytree(ones, tmp_path / "undeclared")
    config = json.loads((undeclared / "config.json").read_text())
    del config["compression_config"]
    (undeclared / "config.json").write_text(json.dumps(config))
    assert any(w.startswith("config.json has no quantization_config or compression_config with a kv_cache_scheme") for w in _inspect(undeclared)["warnings"])


def test_inspect_without_scales_says_so(llama):
    report = _inspect(llama)
    assert report["conventions"] == [] and report["layers"] == []
    assert report["warnings"] == ["no KV scales found: engines use 1.0 for every layer (uncalibrated; run fp8kv calibrate)"]


def test_convert_to_vllm_json_says_which_engine_reads_it(llama, tmp_path):
    src = golden(llama, tmp_path / "ct", "compressed-tensors")
    out = tmp_path / "json"
    result = runner.invoke(app, ["convert", str(src), "--to", "vllm-json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    file = out / "kv_cache_scales.json"
    assert result.stdout.splitlines()[1] == (
        "kv_cache_scales.json: no engine release fp8kv checked runs it: SGLang 0.5.23 takes it (--kv-cache-dtype "
        f"fp8_e4m3 --quantization-param-path {file}) but its attention does not run the value its loader holds, and "
        "vLLM no longer reads it (0.32 runs the folder at scale 1.0): fp8kv convert --to compressed-tensors")
    assert "scales in the legacy vLLM JSON file: no engine release fp8kv checked runs it: SGLang 0.5.23 takes it " \
        "(--kv-cache-dtype fp8_e4m3 --quantization-param-path kv_cache_scales.json)" in " ".join(_inspect(out)["warnings"])
    data = json.loads((out / "kv_cache_scales.json").read_text())
    assert data["kv_cache"] == {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.0625, "1": 0.125}}}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not any("_scale" in name for name in load_file(out / "model.safetensors"))


def test_inspect_and_verify_show_each_finding_once(llama, tmp_path):
    ones = write_checkpoint(llama, tmp_path / "ones", KVScales.from_floats({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}))
    undeclared = shutil.copytree(ones, tmp_path / "undeclared")
    config = json.loads((undeclared / "config.json").read_text())
    del config["compression_config"]
    (undeclared / "config.json").write_text(json.dumps(config))
    findings = check_readout(read_kv_scales(undeclared))
    assert _inspect(undeclared)["warnings"] == [f.message for f in findings]
    reasons = static_checks(undeclared).reasons
    assert [r for r in reasons if "kv_cache_scheme" in r.message] == [
        f for f in findings if f.level == FAIL and "kv_cache_scheme" in f.message]
    assert len([r for r in reasons if "kv_cache_scheme" in r.message]) == 1
    assert len(reasons) == len(set(reasons))


def test_inspect_text_piped_to_a_file_keeps_each_line_whole(capsys) -> None:
    """Piped, rich would wrap at 80 columns mid-sentence; a log reader greps whole warnings."""
    warning = "transformer.h.0.attn.k_scale (and 3 more): vLLM loads gpt2 scales as " + "x" * 120
    InspectReport(path="/tmp/model", model_type="gpt2", conventions=("compressed-tensors",), declared={},
                  kv_dtype="fp8_e4m3", strategy="tensor", num_kv_heads=4, kv_layers=(), latent=None, layers=(),
                  warnings=(warning,)).show()
    assert f"warning: {warning}" in capsys.readouterr().out.splitlines()
