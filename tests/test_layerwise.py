"""Layer-by-layer calibration gives bit-identical statistics and scales to the whole-model path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8kv.calibrate import layerwise
from fp8kv.data import DataRequest, load_calibration_data
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate, observe_whole_model
from fp8kv.data import load_tokenizer
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint

WINDOW = 16  # the factory's sliding window; the corpus's records are longer, so windows matter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Small factory checkpoints whose layers mix sliding and full attention (gemma3: sliding x5, full, sliding)."""
    root = tmp_path_factory.mktemp("layerwise-models")
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_checkpoint(arch, root / arch, num_layers=7 if arch == "gemma3" else 3)
        return built[arch]

    return build


def request_for(model: Path, corpus: str, **options) -> CalibrationRequest:
    return CalibrationRequest(
        model=str(model), data=DataRequest(dataset=corpus, num_samples=6, seq_len=60), batch_size=4, device="cpu", **options
    )


def both_paths(model: Path, corpus: str, spill: bool = False):
    """(whole-model statistics, layer-by-layer statistics) over the same samples and batches."""
    source = SourceCheckpoint.open(model)
    tokenizer = load_tokenizer(source.path, False)
    request = request_for(model, corpus)
    data = load_calibration_data(request.data, tokenizer)
    assert max(len(s) for s in data.samples) > WINDOW
    whole = observe_whole_model(source, data, request, tokenizer)
    by_layer = layerwise.observe_layerwise(source, data, request, tokenizer, spill=spill)
    return whole, by_layer


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_statistics_identical_to_whole_model(arch, models, corpus):
    whole, by_layer = both_paths(models(arch), corpus)
    assert bool((whole.amax > 0).all())
    assert torch.equal(whole.amax, by_layer.amax)
    assert torch.equal(whole.hist, by_layer.hist)
    assert torch.equal(whole.tokens, by_layer.tokens)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_spilled_hidden_states_give_identical_statistics(arch, models, corpus):
    whole, by_layer = both_paths(models(arch), corpus, spill=True)
    assert torch.equal(whole.amax, by_layer.amax)
    assert torch.equal(whole.hist, by_layer.hist)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_scales_and_provenance_identical_end_to_end(arch, models, corpus, tmp_path):
    results = {
        choice: calibrate(request_for(models(arch), corpus, layerwise=choice, out=tmp_path / str(choice)))
        for choice in (False, True)
    }
    assert torch.equal(results[False].table.amax, results[True].table.amax)
    assert torch.equal(results[False].table.scales, results[True].table.scales)
    written = [json.loads((tmp_path / str(c) / "fp8kv.json").read_text()) for c in (False, True)]
    assert written[0]["layers"] == written[1]["layers"]
    assert [w["execution"]["layerwise"] for w in written] == [False, True]
    assert [w["execution"]["processes"] for w in written] == [1, 1]


def test_one_decoder_layer_in_memory_at_a_time(models, corpus, monkeypatch):
    model = models("llama")
    counts = []
    run_layer = layerwise.run_layer

    def counting(base, layers, index, *args, **kwargs):
        real = [i for i, layer in enumerate(layers) if any(not p.is_meta for p in layer.parameters())]
        counts.append((index, real, base.embed_tokens.weight.is_meta))
        return run_layer(base, layers, index, *args, **kwargs)

    monkeypatch.setattr(layerwise, "run_layer", counting)
    calibrate(request_for(model, corpus, layerwise=True))
    # one decoder layer at a time; the embeddings stay, since every layer's arguments are computed from them
    assert counts and all(real == [index] and not embed_meta for index, real, embed_meta in counts)
    assert sorted({index for index, _, _ in counts}) == [0, 1, 2]


def test_spill_file_next_to_output_and_removed(models, corpus, tmp_path, monkeypatch):
    seen = []
    home = layerwise._home

    def spilling(needed, spill, device, layer_bytes):
        seen.append(sorted(p.name for p in tmp_path.glob(".fp8kv-hidden-*/*")))
        return home(needed, True, device, layer_bytes)

    monkeypatch.setattr(layerwise, "_home", spilling)
    result = calibrate(request_for(models("llama"), corpus, layerwise=True, out=tmp_path / "out"))
    assert seen == [[]]  # folder exists, file not yet made when the home is chosen
    assert list(tmp_path.glob(".fp8kv-hidden-*")) == []
    assert result.table.scales.gt(0).all()


def test_sharded_checkpoint_reads_layers_across_files(corpus, tmp_path):
    model = make_checkpoint("qwen3", tmp_path / "sharded", num_layers=3, max_shard_bytes=40_000)
    source = SourceCheckpoint.open(model)
    assert len(source.weight_files) > 2
    whole, by_layer = both_paths(model, corpus)
    assert torch.equal(whole.amax, by_layer.amax)


def test_missing_layer_tensor_is_named(models, corpus, tmp_path):
    model = tmp_path / "broken"
    src = models("llama")
    model.mkdir()
    for path in src.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Fp8kvError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is not in the checkpoint.*--no-layerwise"):
        calibrate(request_for(model, corpus, layerwise=True))


def test_weight_bytes_follow_headers_and_dtype(models):
    source = SourceCheckpoint.open(models("llama"))  # float32 on disk
    stored = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in source.headers.values() for e in h.values())
    assert layerwise.weight_bytes(source) == stored
    assert layerwise.weight_bytes(source, "bfloat16") == stored // 2


def test_automatic_choice_follows_available_memory(models, monkeypatch):
    source = SourceCheckpoint.open(models("llama"))
    size = layerwise.weight_bytes(source)
    monkeypatch.setattr(layerwise, "available_memory", lambda: int(size / 0.6) - 1)
    assert layerwise.choose_layerwise(None, source) is True
    monkeypatch.setattr(layerwise, "available_memory", lambda: int(size / 0.6) + 10)
    assert layerwise.choose_layerwise(None, source) is False
    assert layerwise.choose_layerwise(False, source) is False  # an explicit choice wins
    assert layerwise.available_memory() > 0


def test_cli_flag_reaches_the_request(models, corpus, tmp_path, monkeypatch):
    seen = []
    choose = layerwise.choose_layerwise
    monkeypatch.setattr(layerwise, "choose_layerwise", lambda c, *a: seen.append(c) or choose(c, *a))
    base = ["calibrate", str(models("llama")), "--dataset", corpus, "--num-samples", "6", "--seq-len", "60", "--json"]
    for flag in ("--layerwise", "--no-layerwise", None):
        result = CliRunner().invoke(app, base + ([flag] if flag else []))
        assert result.exit_code == 0, result.output
        json.loads(result.stdout)
    assert seen == [True, False, None]
