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


def test_verify_warns_on_held_out_samples_that_are_calibration_samples_told_by_their_records(
        tmp_path, factory_checkpoint, corpus) -> None:
    from dataclasses import replace

    from fp8kv.checkpoint.provenance import read_provenance
    from fp8kv.data import CalibrationData, load_tokenizer
    from fp8kv.verify.heldout import calibration_overlap

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("llama")), "--out", str(out), "--dataset",
                                      corpus, "--num-samples", "4", "--seq-len", "64", "--quiet"])
    assert result.exit_code == 0, result.output
    recorded = read_provenance(out).dataset
    assert len(recorded.sample_digests) == 4 and "text" not in json.dumps(recorded.sample_digests)
    source, tokenizer = SourceCheckpoint.open(out), load_tokenizer(out, False)
    read = lambda seq_len: load_calibration_data(DataRequest(corpus, num_samples=4, seq_len=seq_len), tokenizer)  # noqa: E731
    again, longer, shorter = read(64), read(96), read(40)
    assert any(len(sample) == 64 for sample in again.samples) and any(len(s) > 64 for s in longer.samples)
    assert calibration_overlap(source, again).startswith("4 of 4 held-out samples begin with calibration samples")
    assert calibration_overlap(source, longer).startswith("4 of 4 ")  # the same records at a longer --seq-len
    # a record cut shorter than calibrate read it is not told apart from other text (here: the corpus's shortest
    # records, whole at both lengths, are)
    assert calibration_overlap(source, shorter) == _overlap(sum(len(s) < 40 for s in again.samples), 4)
    other = [list(reversed(sample)) for sample in again.samples]
    # the same file and split, other records: seen text only where the records are the same
    assert calibration_overlap(source, replace(again, samples=other)) is None
    assert calibration_overlap(source, replace(again, samples=[other[0], again.samples[1]])).startswith("1 of 2 ")
    # chat samples share their template's first tokens: only the whole sample tells a record
    template = again.samples[0][:30]
    assert calibration_overlap(source, replace(again, samples=[template + [7] * 40])) is None
    unrelated = CalibrationData(again.samples, "elsewhere.jsonl", "train", "text")
    assert calibration_overlap(source, unrelated).startswith("4 of 4 ")  # the records decide, not the file's name

    # a record written before fp8kv kept digests is judged by its dataset name and split
    record = json.loads((out / "fp8kv.json").read_text())
    del record["dataset"]["sample_digests"]
    (out / "fp8kv.json").write_text(json.dumps(record))
    assert "is the calibration data recorded in fp8kv.json" in calibration_overlap(source, replace(again, samples=other))
    assert calibration_overlap(source, unrelated) is None


def _overlap(shared: int, total: int) -> str | None:
    return None if not shared else (f"{shared} of {total} held-out samples begin with calibration samples recorded "
                                    "in fp8kv.json: saturation and accuracy are measured on seen text; pass --dataset "
                                    "with other text")
