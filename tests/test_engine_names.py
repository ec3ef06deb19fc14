"""Scale tensor names vLLM loads: the full `<module>.attn` path where its model file looks scales up by exact
name (GPT-2), the attention module's own path where it remaps them (Llama); both read back and convert."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.checkpoint.conventions import SCALES_FILE  # noqa: E402
from fp8kv.checkpoint.convert import convert_checkpoint  # noqa: E402
from fp8kv.checkpoint.engine_names import FULL_PATH_MODEL_TYPES  # noqa: E402
from fp8kv.checkpoint.kvscales import KVScales  # noqa: E402
from fp8kv.checkpoint.reader import read_kv_scales  # noqa: E402
from fp8kv.checkpoint.writer import write_checkpoint  # noqa: E402
from fp8kv.cli import app  # noqa: E402
from fp8kv.data import DataRequest  # noqa: E402
from fp8kv.inspection import ScaleRow, scale_rows  # noqa: E402
from fp8kv.models import BUNDLED_CALIBRATION_TEXT  # noqa: E402
from fp8kv.tools.zoo import make_zoo_checkpoint  # noqa: E402
from fp8kv.verify.request import VerifyRequest  # noqa: E402
from fp8kv.verify.run import verify  # noqa: E402

# Powers of two: exact in every dtype a scale passes through.
K = {0: 0.015625, 1: 0.03125}
V = {0: 0.0625, 1: 0.125}
# What each architecture's output must hold, spelled out: vLLM's gpt2.py looks `transformer.h.N.attn.attn.k_scale`
# up by name; its llama.py remaps `model.layers.N.self_attn.k_scale` onto `...self_attn.attn.k_scale` itself.
EXPECTED = {
    "gpt2": {f"transformer.h.{i}.attn.attn.{kind}_scale" for i in (0, 1) for kind in "kv"},
    "llama": {f"model.layers.{i}.self_attn.{kind}_scale" for i in (0, 1) for kind in "kv"},
}
ROWS = [{"layer": i, "k_scale": K[i], "v_scale": V[i]} for i in (0, 1)]


def _scale_names(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / SCALES_FILE), framework="pt") as handle:
        return set(handle.keys())


def _inspect(model_dir: Path) -> dict:
    result = CliRunner().invoke(app, ["inspect", str(model_dir), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a tiny checkpoint of it written with the scales above in compressed-tensors."""
    scales = KVScales.from_floats(K, V)
    root = tmp_path_factory.mktemp("engine_names")
    return {t: write_checkpoint(make_zoo_checkpoint(t, root / t), root / f"{t}-out", scales) for t in EXPECTED}


def test_full_path_model_types_are_transformers_model_types():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert sorted(FULL_PATH_MODEL_TYPES - set(CONFIG_MAPPING_NAMES)) == []
    assert "gpt2" in FULL_PATH_MODEL_TYPES and "llama" not in FULL_PATH_MODEL_TYPES


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_written_names_are_the_ones_vllm_loads(outputs, model_type):
    out = outputs[model_type]
    assert _scale_names(out) == EXPECTED[model_type]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {name for name, file in index.items() if file == SCALES_FILE} == EXPECTED[model_type]


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_inspect_reads_the_written_names_back(outputs, model_type):
    report = _inspect(outputs[model_type])
    assert (report["conventions"], report["layers"], report["warnings"]) == (["compressed-tensors"], ROWS, [])


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_convert_round_trips_through_every_convention_back_to_the_vllm_names(outputs, model_type, tmp_path):
    path = outputs[model_type]
    for convention in ("modelopt", "quark", "vllm-json", "compressed-tensors"):
        path = convert_checkpoint(path, tmp_path / convention, convention)
        readout = read_kv_scales(path)
        assert (readout.conventions, scale_rows(readout.scales)) == ((convention,), tuple(ScaleRow(**r) for r in ROWS))
    assert _scale_names(path) == EXPECTED[model_type]


def test_gpt2_scales_under_the_attention_module_name_still_read_and_convert_to_the_vllm_names(outputs, tmp_path):
    """A GPT-2 output written before the full path (`transformer.h.N.attn.k_scale`) is read, and convert renames it."""
    out, old = outputs["gpt2"], tmp_path / "old"
    shutil.copytree(out, old)
    with safe_open(str(out / SCALES_FILE), framework="pt") as handle:
        tensors = {name.replace(".attn.attn.", ".attn."): handle.get_tensor(name) for name in handle.keys()}
    save_file(tensors, str(old / SCALES_FILE), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name.replace(".attn.attn.", ".attn."): file for name, file in index["weight_map"].items()}
    (old / "model.safetensors.index.json").write_text(json.dumps(index))
    report = _inspect(old)
    assert report["layers"] == ROWS
    assert report["warnings"] == [
        "transformer.h.0.attn.k_scale (and 3 more): vLLM loads gpt2 scales as transformer.h.0.attn.attn.k_scale and "
        "leaves these at 1.0 or refuses the checkpoint; fp8kv convert --to compressed-tensors renames them"]
    renamed = convert_checkpoint(old, tmp_path / "renamed", "compressed-tensors")
    assert (_scale_names(renamed), _inspect(renamed)["warnings"]) == (EXPECTED["gpt2"], [])


def test_verify_reads_the_gpt2_full_path_names(outputs, tmp_path):
    from pydoc_data.topics import topics

    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": topics[k][:300]}) + "\n" for k in sorted(topics)[40:42]))
    request = VerifyRequest(outputs["gpt2"], data=DataRequest(str(held), num_samples=2, seq_len=32), batch_size=2,
                            num_prompts=1, prompt_len=16, new_tokens=1, device="cpu", report_dir=tmp_path / "report")
    assert verify(request).report.scales == tuple(ScaleRow(**row) for row in ROWS)


@pytest.mark.parametrize("model_type, convention, note", [
    ("gpt2", "modelopt", "note: vLLM (0.32) loads ModelOpt's k_proj.k_scale only under a self_attn module and gpt2's "
                         "attention module is attn, so it refuses this folder; for vLLM, fp8kv convert --to "
                         "compressed-tensors"),
    ("gemma2", "quark", "note: vLLM (0.32)'s gemma2 loader maps k_proj onto the fused qkv_proj before Quark's scale "
                        "names, so it refuses k_proj.output_scale; for vLLM, fp8kv convert --to compressed-tensors"),
    ("llama", "modelopt", None),
    ("llama", "quark", None),
    ("gpt2", "quark", None),
])
def test_convert_names_the_formats_vllm_refuses_for_the_architecture(tmp_path, model_type, convention, note):
    scales = KVScales.from_floats(K, V)
    src = write_checkpoint(make_zoo_checkpoint(model_type, tmp_path / "src"), tmp_path / "ct", scales)
    out = tmp_path / convention
    result = CliRunner().invoke(app, ["convert", str(src), "--to", convention, "--out", str(out)])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "vLLM (0.32)" in line]
    assert notes == ([note] if note else [])
    warned = [w for w in _inspect(out)["warnings"] if "vLLM (0.32)" in w]
    assert warned == ([note.removeprefix("note: ")] if note else [])


def test_calibrate_to_a_format_vllm_refuses_for_the_architecture_says_so(tmp_path):
    src = make_zoo_checkpoint("gpt2", tmp_path / "gpt2")
    result = CliRunner().invoke(app, ["calibrate", str(src), "--dataset", str(BUNDLED_CALIBRATION_TEXT), "-q",
                                      "--num-samples", "4", "--seq-len", "16", "--format", "modelopt",
                                      "--out", str(tmp_path / "mo")])
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if "vLLM (0.32)" in line] == [
        "fp8kv: vLLM (0.32) loads ModelOpt's k_proj.k_scale only under a self_attn module and gpt2's attention "
        "module is attn, so it refuses this folder; for vLLM, fp8kv convert --to compressed-tensors"]
