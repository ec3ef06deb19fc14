"""Calibration and held-out text for a model that is not bundled: never the bundled corpus silently,
and `--dataset generated`, text the model writes itself, seeded."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from fp8kv import data as data_module
from fp8kv.checkpoint.locate import BUNDLED_MODELS, is_bundled_model
from fp8kv.checkpoint.provenance import Provenance, SourceRecord
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.cli import app
from fp8kv.data import GENERATED_DATASET, DataRequest, load_calibration_data
from fp8kv.errors import ExitCode
from fp8kv.models import BUNDLED_CONTENT_HASHES, BUNDLED_MODEL_DIR

GENERATED = ["--dataset", GENERATED_DATASET, "--num-samples", "3", "--seq-len", "80"]


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setattr(data_module, "DEFAULT_DATASET", "fp8kv-tests/no-such-dataset")
    monkeypatch.setattr(data_module, "_hub_reachable", lambda: False)


def test_a_bundled_model_and_what_fp8kv_derived_from_it_are_bundled(tmp_path, factory_checkpoint) -> None:
    derived = tmp_path / "calibrated"
    derived.mkdir()
    record = Provenance(version="0", command=None, format="compressed-tensors",
                        source=SourceRecord(str(BUNDLED_MODEL_DIR), None, None))
    (derived / "fp8kv.json").write_text(record.to_json())
    assert (is_bundled_model(BUNDLED_MODEL_DIR), is_bundled_model(derived)) == (True, True)
    assert is_bundled_model(factory_checkpoint("llama")) is False


def test_a_folder_calibrated_from_a_bundled_model_by_another_install_is_bundled(tmp_path, factory_checkpoint):
    # another install keeps its bundled models in another folder: the recorded content hash still names them
    assert BUNDLED_CONTENT_HASHES == {SourceCheckpoint.open(folder).content_hash() for folder in BUNDLED_MODELS.values()}
    elsewhere = tmp_path / "other-venv" / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, elsewhere)
    for source, expected in ((elsewhere, True), (factory_checkpoint("llama"), False)):
        derived = tmp_path / f"calibrated-{expected}"
        derived.mkdir()
        content_hash = SourceCheckpoint.open(source).content_hash()
        record = Provenance(version="0", command=None, format="compressed-tensors",
                            source=SourceRecord(str(source), content_hash, None))
        (derived / "fp8kv.json").write_text(record.to_json())
        assert is_bundled_model(derived) is expected


def test_calibrate_refuses_the_bundled_corpus_for_another_model(offline, tmp_path, factory_checkpoint) -> None:
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(tmp_path / "o"),
                                      "--quiet"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stderr.count("\n") == 1 and "pass --dataset (" in result.stderr
    assert not (tmp_path / "o").exists()


def test_generated_text_is_seeded_chat_answers_recorded_in_provenance(tmp_path, factory_checkpoint) -> None:
    from transformers import AutoTokenizer

    from fp8kv.checkpoint.load import load_language_model

    src = factory_checkpoint("llama")
    tokenizer, model = AutoTokenizer.from_pretrained(src), load_language_model(src, "cpu")
    ask = lambda seed, held_out=False: load_calibration_data(  # noqa: E731
        DataRequest(GENERATED_DATASET, num_samples=3, seq_len=80, seed=seed), tokenizer, model=model, held_out=held_out)
    first, again, other = ask(1), ask(1), ask(2)
    assert first.samples == again.samples and first.samples != other.samples
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": data_module._INSTRUCTIONS["calibration"][0]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.samples[0][: len(prompt)] == list(prompt) and len(first.samples[0]) > len(prompt)
    assert all(len(sample) <= 80 for sample in first.samples)
    assert (first.dataset, first.split, ask(1, held_out=True).split) == (GENERATED_DATASET, "calibration", "heldout")

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["calibrate", str(src), "--out", str(out), *GENERATED, "--seed", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    dataset = json.loads((out / "fp8kv.json").read_text())["dataset"]
    assert (dataset["name"], dataset["split"], dataset["seed"], dataset["num_samples"]) == ("generated", "calibration", 1, 3)
    assert "seed 1" in dataset["note"] and "temperature 0.7" in dataset["note"]


def test_verify_refuses_the_bundled_held_out_text_for_another_model_and_reads_generated(offline, tmp_path,
                                                                                       factory_checkpoint) -> None:
    out = tmp_path / "out"
    calibrated = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(out),
                                          *GENERATED, "--quiet"])
    assert calibrated.exit_code == 0, calibrated.output
    refused = CliRunner().invoke(app, ["verify", str(out), "--quiet"])
    assert refused.exit_code == ExitCode.USAGE, refused.output
    assert refused.stderr == (f"fp8kv: error: {out}: verify's default held-out text is the bundled model's corpus, "
                              "which says nothing about this model; pass --dataset (a .txt/.jsonl/.parquet file, a Hub "
                              "dataset org/name, or 'generated' (text the model writes itself)), not its calibration "
                              "text\n")
    verified = CliRunner().invoke(app, ["verify", str(out), *GENERATED, "--engine", "vllm-tpu", "--quiet"])
    assert verified.exit_code in (ExitCode.PASS, ExitCode.WARN), verified.output
    report = json.loads((out / "verify" / "report.json").read_text())
    assert "generated" in report["text_source"] and "heldout" in report["text_source"]
    assert not any("calibration data recorded" in reason["message"] for reason in report["reasons"])
