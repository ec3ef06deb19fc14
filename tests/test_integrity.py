"""Nothing stale is published: derived folders carry no verdict, card or provenance of their source,
and card/push refuse a verify report that judged other files than the folder holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8kv.checkpoint.artifacts import CARD_FILE, PROVENANCE_FILE, is_fp8kv_card
from fp8kv.checkpoint.provenance import ConvertedFrom, read_provenance
from fp8kv.checks import WARN, Finding
from fp8kv.cli import app
from fp8kv.errors import ExitCode
from fp8kv.evaluation.results import ConfigScores, EvalResults
from fp8kv.hub.card import write_card
from tests.reports import report_for, write_report

DATA_ARGS = ["--num-samples", "4", "--seq-len", "16", "--batch-size", "2"]


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def judged(tmp_path_factory, factory_checkpoint, corpus) -> Path:
    """A calibrated folder with everything fp8kv writes about it: a report with its digest, a card, eval results."""
    out = tmp_path_factory.mktemp("judged") / "out1"
    result = run("calibrate", factory_checkpoint("llama"), "--out", out, "--dataset", corpus, *DATA_ARGS)
    assert result.exit_code == 0, result.output
    write_report(out, report_for(out, (Finding(WARN, "layer 1: 0.042% of K values saturate"),)))
    (out / "eval").mkdir()
    scores = ConfigScores("bf16", "bf16", "-", "-", {"task acc": 0.5}, nonfinite_stored=0)
    (out / "eval" / "results.json").write_text(EvalResults(str(out), ("task",), None, "cpu", (scores,)).to_json())
    write_card(out)
    return out


def _assert_fresh(out: Path, source: Path) -> None:
    assert not (out / "verify").exists() and not (out / "eval").exists()
    assert not (out / CARD_FILE).exists()
    assert read_provenance(out).source.path != str(out)
    assert is_fp8kv_card(source / CARD_FILE), "the source's own card is untouched"


def test_recalibrated_output_carries_nothing_of_its_source(judged, tmp_path, corpus):
    out = tmp_path / "recal"
    result = run("calibrate", judged, "--strategy", "percentile:90", "--out", out, "--dataset", corpus, *DATA_ARGS)
    assert result.exit_code == 0, result.output
    _assert_fresh(out, judged)
    assert read_provenance(out).strategy == "percentile:90"


def test_every_written_file_gets_the_same_permissions(judged):
    modes = {path.name: path.stat().st_mode & 0o777 for path in judged.iterdir()
             if path.is_file() and path.stat().st_nlink == 1 and path.name != CARD_FILE}
    assert modes["kv_scales.safetensors"] == modes["config.json"] == modes[PROVENANCE_FILE], modes


def test_converted_output_has_its_own_provenance(judged, tmp_path):
    out = tmp_path / "conv"
    result = run("convert", judged, "--to", "modelopt", "--out", out)
    assert result.exit_code == 0, result.output
    _assert_fresh(out, judged)
    record = read_provenance(out)
    assert record.format == "modelopt"
    assert record.converted_from == ConvertedFrom(str(judged), ("compressed-tensors",))
    assert record.layers == read_provenance(judged).layers


def test_a_user_readme_in_the_source_is_kept(tmp_path, factory_checkpoint, corpus):
    source = shutil.copytree(factory_checkpoint("llama"), tmp_path / "src")
    (source / CARD_FILE).write_text("---\nlicense: mit\n---\n# mine\n")
    out = tmp_path / "out"
    assert run("calibrate", source, "--out", out, "--dataset", corpus, *DATA_ARGS).exit_code == 0
    assert (out / CARD_FILE).read_text() == "---\nlicense: mit\n---\n# mine\n"


def test_push_and_card_refuse_a_report_copied_from_another_folder(judged, tmp_path, corpus):
    out = tmp_path / "recal"
    assert run("calibrate", judged, "--strategy", "percentile:90", "--out", out, "--dataset", corpus,
               *DATA_ARGS).exit_code == 0
    shutil.copytree(judged / "verify", out / "verify")
    for args in (["push", out, "--repo-id", "org/name", "--dry-run"], ["push", out, "--repo-id", "org/name",
                                                                         "--dry-run", "--force"], ["card", out]):
        result = run(*args)
        assert result.exit_code == ExitCode.ERROR, result.output
        line = result.stderr.strip()
        assert "report.json: judged other files than" in line, line
        assert "scale model.layers.0.self_attn.k_scale changed" in line, line
    assert not (out / CARD_FILE).exists()


def test_report_names_a_changed_config_and_weight_file(judged, tmp_path):
    out = shutil.copytree(judged, tmp_path / "copy")
    config = json.loads((out / "config.json").read_text())
    config["compression_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (out / "config.json").write_text(json.dumps(config))
    result = run("card", out)
    assert result.exit_code == ExitCode.ERROR
    assert "the config's quantization block changed" in result.stderr
    assert "weight file" not in result.stderr


def test_matching_report_is_accepted(judged):
    result = run("push", judged, "--repo-id", "org/name", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Last verify: WARN" in result.output


def _drop_lm_head(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        if tensors.pop("lm_head.weight", None) is not None:
            path.unlink()  # a hard link into the source: write a new file instead
            save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_verify_fails_when_transformers_invents_weights(tmp_path, factory_checkpoint, corpus):
    out = tmp_path / "out"
    assert run("calibrate", factory_checkpoint("llama"), "--out", out, "--dataset", corpus, "--mode", "copy",
               *DATA_ARGS).exit_code == 0
    _drop_lm_head(out)
    result = run("verify", out, "--dataset", corpus, "--num-samples", "2", "--seq-len", "16", "--num-prompts", "1",
                 "--new-tokens", "1", "--device", "cpu", "--json")
    assert result.exit_code == ExitCode.FAIL, result.output
    report = json.loads(result.stdout)
    fails = [r["message"] for r in report["reasons"] if r["level"] == "FAIL"]
    assert any("1 weight(s) missing (randomly initialized): lm_head.weight" in m for m in fails), fails
    assert report["accuracy"] is None


def test_verify_never_writes_into_a_folder_fp8kv_did_not_write(judged, tmp_path, corpus, monkeypatch):
    theirs = shutil.copytree(judged, tmp_path / "theirs", ignore=shutil.ignore_patterns("verify", "eval", "*.md",
                                                                                          PROVENANCE_FILE))
    before = sorted(p.name for p in theirs.iterdir())
    monkeypatch.chdir(tmp_path)
    result = run("verify", theirs, "--dataset", corpus, "--num-samples", "2", "--seq-len", "16", "--num-prompts", "1",
                 "--new-tokens", "1", "--device", "cpu")
    assert result.exit_code in (ExitCode.PASS, ExitCode.WARN), result.output
    assert sorted(p.name for p in theirs.iterdir()) == before
    report = tmp_path / "fp8kv-verify" / "theirs" / "report.md"
    assert report.is_file() and f"report: {report}" in result.stdout


def test_base_model_is_recorded_kept_and_overridable(judged, tmp_path, corpus):
    from huggingface_hub import ModelCard

    first, second = tmp_path / "first", tmp_path / "second"
    assert run("calibrate", judged, "--base-model", "org/tiny", "--out", first, "--dataset", corpus,
               *DATA_ARGS).exit_code == 0
    assert run("calibrate", first, "--out", second, "--dataset", corpus, *DATA_ARGS).exit_code == 0
    assert read_provenance(second).source.base_model == "org/tiny"
    assert run("card", second).exit_code == 0
    assert ModelCard.load(second / CARD_FILE).data.base_model == "org/tiny"
    assert run("card", second, "--base-model", "org/other").exit_code == 0
    assert ModelCard.load(second / CARD_FILE).data.base_model == "org/other"
    bad = run("card", second, "--base-model", "/local/path")
    assert bad.exit_code == ExitCode.USAGE
    assert "Invalid value for '--base-model': '/local/path': not a Hub model id" in bad.stderr


def test_verify_takes_a_hub_id_and_never_writes_into_the_hub_cache(judged, tmp_path, corpus, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(judged, snapshot, ignore=shutil.ignore_patterns("verify", "eval"))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in snapshot.iterdir())
    result = run("verify", "org/tiny", "--dataset", corpus, "--num-samples", "2", "--seq-len", "16", "--num-prompts",
                 "1", "--new-tokens", "1", "--device", "cpu")
    assert result.exit_code in (ExitCode.PASS, ExitCode.WARN), result.output
    assert (tmp_path / "fp8kv-verify" / "org--tiny" / "report.json").is_file()
    assert sorted(p.name for p in snapshot.iterdir()) == before
