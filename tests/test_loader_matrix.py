"""The loader matrix: what each engine release's own loader held per model class and fp8kv format, as
probes/probe_loaders.py recorded it under tests/golden/, against configs/engines.toml and docs/engines.md; and what
verify makes of it (`EngineModel.for_checkpoint`). No engine is installed here."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import fp8kv
from fp8kv.engine_models import (
    HOLDS, NOT_STARTED, REACHES_CACHE, RELEASE_MODELS, SOURCE, CheckpointTraits, EngineModel, LoaderHeld, engine_model,
    loader_release,
)
from fp8kv.loadcheck.run import PROBES, LayerLoad, LoadCheckReport

GOLDEN = Path(__file__).parent / "golden"
MATRICES = [m for m in RELEASE_MODELS if m.release and m.release.loaders and not m.release.loader_from]
LENT = [m for m in RELEASE_MODELS if m.release and m.release.loader_from]


def _probe_loaders() -> Any:
    """probes/probe_loaders.py, which wrote the golden files and prints the rows of the toml and the docs."""
    spec = importlib.util.spec_from_file_location("probe_loaders", GOLDEN.parents[1] / "probes" / "probe_loaders.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


PROBE = _probe_loaders()


def matrix(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text(encoding="utf-8"))


def recorded(golden: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(model class, format) -> what the loader held, over the zoo model types of that class."""
    out: dict[tuple[str, str], set[str]] = {}
    for row in PROBE.class_rows(golden):
        for name, load in row.items():
            if name != "class":
                out.setdefault((row["class"], name), set()).add(load["holds"])
    return out


def test_the_newest_sglang_and_vllm_cpu_rows_have_a_loader_matrix():
    assert {m.name for m in MATRICES} == {engine_model("sglang").name, engine_model("vllm-cpu").name}


@pytest.mark.parametrize("model", MATRICES, ids=lambda m: m.name)
def test_each_row_holds_exactly_what_its_engine_loader_held(model):
    release = model.release
    golden = matrix(release.loaders)
    assert golden["version"] == release.label and golden["engine"] == release.engine
    seen = recorded(golden)
    assert all(len(held) == 1 for held in seen.values()), "model types of one class disagree"
    assert {(c, f): next(iter(h)) for (c, f), h in seen.items()} == {
        (c, row.convention): row.holds for row in release.loader for c in row.architectures}
    # a convention is one the release reads exactly when its loader held it for some class
    reached = {f for (_, f), held in seen.items() if held <= set(REACHES_CACHE) and f != SOURCE}
    assert reached == set(release.conventions) & {f for _, f in seen}


def test_vllm_cuda_0_32_takes_the_cpu_wheels_matrix_over_but_for_quark():
    cuda = engine_model("vllm-cuda@0.32.0").release
    assert [m.name for m in LENT] == ["vllm-cuda@0.32.0"] and cuda.loader_from == engine_model("vllm-cpu").name
    cpu = engine_model("vllm-cpu").release
    assert cuda.loaders == cpu.loaders and cuda.load_check == cpu.load_check
    assert cuda.loader == tuple(held for held in cpu.loader if held.convention != "quark")
    # the newest CUDA release's loader path changed: no matrix there
    assert not engine_model("vllm-cuda").release.loader
    # load-check on vLLM 0.32.0 is judged by the row whose own loader made the matrix
    assert loader_release("vllm", "0.32.0") is cpu


@pytest.mark.parametrize("model", MATRICES, ids=lambda m: m.name)
def test_every_load_says_what_the_engine_said(model):
    for model_type, row in matrix(model.release.loaders)["architectures"].items():
        for name, load in row.items():
            if name == "class":
                continue
            assert load["holds"] in HOLDS, (model_type, name)
            if load["holds"] == NOT_STARTED:
                assert load["error"] and not load["error"].startswith("For further information"), (model_type, name)
            else:
                assert load["held"], (model_type, name)


def test_docs_state_the_matrix_time_and_every_class_per_engine():
    docs = (Path(fp8kv.__file__).parent / "docs" / "engines.md").read_text(encoding="utf-8")
    for model in MATRICES:
        golden = matrix(model.release.loaders)
        seconds = golden["provenance"]["matrix_wall_s"]
        assert f"{seconds / 60:.1f} minutes" in docs
        for line in PROBE.docs_rows(golden).splitlines():
            assert line in docs


def _sglang_held(model_class: str, name: str) -> str:
    golden = recorded(matrix(engine_model("sglang").release.loaders))
    return next(iter(golden[(model_class, name)]))


def test_sglang_on_qwen2_runs_one_and_says_why_and_which_route_works():
    assert _sglang_held("Qwen2ForCausalLM", "compressed-tensors") == "1.0"
    vllm_cpu = recorded(matrix(engine_model("vllm-cpu").release.loaders))
    assert vllm_cpu[("Qwen2ForCausalLM", "compressed-tensors")] == {"file"}
    traits = CheckpointTraits(("Qwen2ForCausalLM",), ("compressed-tensors",), False, "/ckpt/qwen2")
    model = engine_model("sglang").for_checkpoint(traits)
    assert model.ignores_scales and model.starts and not model.unchecked
    assert "its loader held 1.0 in every attention layer on Qwen2ForCausalLM with compressed-tensors" in model.unread
    assert "loaders-sglang-0.5.23.json" in model.unread
    assert "serve it with vllm-cuda 0.32.0 or vllm-cpu 0.32.0" in model.unread  # its ModelOpt route holds 1.0 too
    llama = engine_model("sglang").for_checkpoint(
        CheckpointTraits(("LlamaForCausalLM",), ("compressed-tensors",), False))
    assert not llama.ignores_scales and not llama.unread and not llama.unchecked


def test_an_architecture_the_matrix_has_not_seen_is_unchecked_with_the_command_to_run():
    traits = CheckpointTraits(("NoSuchForCausalLM",), ("compressed-tensors",), False, "/ckpt/new")
    model = engine_model("sglang").for_checkpoint(traits)
    assert not model.ignores_scales and model.starts
    assert model.unchecked.startswith("sglang 0.5.23's loader has not been run on NoSuchForCausalLM here")
    assert model.unchecked.endswith("fp8kv load-check /ckpt/new --engine sglang --python ENGINE_VENV/bin/python")
    # a release with no loader matrix says nothing of the kind
    assert not engine_model("vllm-cuda").for_checkpoint(traits).unchecked


def _serving(loader: tuple[LoaderHeld, ...]) -> EngineModel:
    """SGLang's newest release model with a loader matrix of `loader` alone."""
    sglang = engine_model("sglang")
    return replace(sglang, release=replace(sglang.release, loader=loader, engine="engine", versions=("1.0", "1.0")))


def test_a_class_that_starts_without_scales_but_not_with_them_does_not_start():
    model = _serving((LoaderHeld(SOURCE, "none", ("A",)), LoaderHeld("compressed-tensors", NOT_STARTED, ("A",)),
                      LoaderHeld("modelopt", "file", ("A",))))
    served = model.for_checkpoint(CheckpointTraits(("A",), ("compressed-tensors",), False, "/c"))
    assert not served.starts and served.ignores_scales
    assert "did not start on A with compressed-tensors scales" in served.unread
    assert "while it starts on the same model without scales" in served.unread
    assert served.unread.endswith("fp8kv convert /c --to modelopt --out /c-modelopt")


def test_a_class_the_engine_cannot_start_even_without_scales_is_unchecked():
    model = _serving((LoaderHeld(SOURCE, NOT_STARTED, ("A",)), LoaderHeld("compressed-tensors", NOT_STARTED, ("A",))))
    served = model.for_checkpoint(CheckpointTraits(("A",), ("compressed-tensors",), False, "/c"))
    assert served.starts and not served.ignores_scales
    assert "loader did not start on A here" in served.unchecked


def _report(*layers: LayerLoad) -> LoadCheckReport:
    return LoadCheckReport("sglang", "0.5.23", "2.14.1", "/c", layers, ())


@pytest.mark.parametrize("held_k, held_v, holds", [
    (0.0123, 0.0456, "file"),
    (0.01229858398, 0.045654296875, "rounded"),  # bf16 neighbours of the file's values
    (1.0, 1.0, "1.0"),
    (None, None, "none"),
    (0.0456, 0.0456, "other"),  # V holds K's value: one scale per layer
])
def test_what_the_layers_hold_over_all_of_them(held_k, held_v, holds):
    assert _report(LayerLoad(0, 0.0123, 0.0456, held_k, held_v)).holds == holds


def test_one_layer_holding_one_and_another_the_file_is_other():
    report = _report(LayerLoad(0, 0.0123, 0.0456, 0.0123, 0.0456), LayerLoad(1, 0.0123, 0.0456, 1.0, 1.0))
    assert report.holds == "other"


def probe_io() -> Any:
    spec = importlib.util.spec_from_file_location("probe_io", PROBES / "probe_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_error_line_is_the_innermost_cause_not_a_wrappers_last_line():
    io = probe_io()
    try:
        try:
            raise ValueError("Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected")
        except ValueError as exc:
            raise RuntimeError("Value error\nFor further information visit https://errors.pydantic.dev/2.14/v") from exc
    except RuntimeError as wrapped:
        line = io.engine_error(wrapped, [])
    assert line == "ValueError: Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected"


def test_an_error_the_engine_logged_comes_first_with_its_cause():
    io = probe_io()
    log = io.EngineLog("fakeengine")
    try:
        raise ModuleNotFoundError("No module named 'torchvision'")
    except ModuleNotFoundError:
        logging.getLogger("fakeengine.registry").error("Error in inspecting model architecture 'X'",
                                                       exc_info=sys.exc_info())
    logging.getLogger("fakeengine.loader").warning("Parameter model.layers.0.self_attn.k_scale not found")
    logging.getLogger("other").warning("k_scale from someone else")
    lines, errors = log.take()
    assert errors == ["Error in inspecting model architecture 'X': ModuleNotFoundError: No module named 'torchvision'"]
    assert io.engine_error(RuntimeError("wrapped"), errors) == errors[0]
    assert lines == ["WARNING: Parameter model.layers.0.self_attn.k_scale not found"]
    assert log.take() == ([], [])


def test_verify_fails_an_engine_that_does_not_start_and_names_an_unchecked_one():
    from fp8kv.verify.run import loader_reasons

    model = _serving((LoaderHeld(SOURCE, "none", ("A",)), LoaderHeld("compressed-tensors", NOT_STARTED, ("A",))))
    traits = CheckpointTraits(("A",), ("compressed-tensors",), False, "/c")
    unchecked = CheckpointTraits(("B",), ("compressed-tensors",), False, "/c")
    reasons = loader_reasons((model.for_checkpoint(traits), model.for_checkpoint(unchecked)))
    assert [(r.level, r.message.split(":")[0]) for r in reasons] == [
        ("FAIL", f"engine {model.name} does not start on this checkpoint"), ("INFO", f"engine {model.name}")]
    assert "no format or engine release fp8kv has run holds this model's scales" in reasons[0].message


def test_load_check_names_the_route_and_a_rounded_hold(tmp_path):
    from fp8kv.checkpoint.kvscales import KVScales
    from fp8kv.checkpoint.writer import write_checkpoint
    from fp8kv.loadcheck.run import load_check, render
    from fp8kv.tools.factory import make_checkpoint

    folder = write_checkpoint(make_checkpoint("llama", tmp_path / "src"), tmp_path / "ct",
                              KVScales.from_floats(k={0: 0.0123, 1: 0.0456}, v={0: 0.0789, 1: 0.0321}))
    python = tmp_path / "python"

    def held(k: list[float], v: list[float]) -> None:
        layers = [{"layer": i, "k_scale": k[i], "v_scale": v[i]} for i in range(2)]
        answer = {"engine": "vllm", "version": "0.32.0", "torch": "2.13.0+cpu", "warnings": [], "layers": layers}
        python.write_text(f"#!{sys.executable}\nimport sys; print({json.dumps(json.dumps(answer))})\n")
        python.chmod(0o755)

    held([1.0, 1.0], [1.0, 1.0])
    report = load_check(folder, "vllm", python)
    assert report.holds == "1.0"
    assert report.route == (f"its loader holds this model's scales in modelopt: fp8kv convert {folder} --to modelopt "
                            f"--out {folder}-modelopt")
    assert f"route: {report.route}" in render(report)
    held([0.01229858398, 0.045654296875], [0.0791015625, 0.0321044921875])
    report = load_check(folder, "vllm", python)
    assert report.holds == "rounded" and not report.route
    assert render(report).endswith("every layer holds it rounded (within a bf16 step: vllm keeps it in the model's dtype)")
