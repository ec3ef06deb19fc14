"""Layouts of released checkpoints that tiny default configs hide: GPT-NeoX without `is_decoder`,
Falcon's new decoder architecture (K/V broadcast to every query head before the cache), and a
checkpoint transformers itself cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fp8kv.transformers_cache import cache_kwargs, fold_repeated_heads
from fp8kv.cli import app
from fp8kv.errors import ExitCode, Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.tools.zoo import make_zoo_checkpoint, make_zoo_config
from fp8kv.tools.zoo_matrix import corpus

NEW_FALCON = {"new_decoder_architecture": True, "num_kv_heads": 2}  # Falcon-40B's layout: 4 heads, 2 KV heads


def test_a_gpt_neox_config_without_is_decoder_is_a_causal_decoder(tmp_path) -> None:
    """Pythia's config.json has no is_decoder; GPTNeoXConfig defaults it to false, its attention is causal."""
    folder = make_zoo_config("gpt_neox", tmp_path / "neox")
    config = json.loads((folder / "config.json").read_text())
    config.pop("is_decoder", None)
    (folder / "config.json").write_text(json.dumps(config))
    geometry = AttentionGeometry.from_dir(folder)
    assert (geometry.model_type, geometry.kv_layers, geometry.num_kv_heads) == ("gpt_neox", (0, 1), 4)


def test_broadcast_kv_heads_fold_back_only_when_they_are_copies() -> None:
    kv = torch.randn(1, 2, 3, 8)  # [batch, kv_heads, seq, head_dim]
    assert torch.equal(fold_repeated_heads(kv.repeat_interleave(3, dim=1), 2, "layer 0"), kv)
    with pytest.raises(Fp8kvError, match=r"^layer 1: the cache update got 6 K/V heads that are not copies of the "
                                         r"config's 2 KV heads"):
        fold_repeated_heads(kv.repeat(1, 3, 1, 1), 2, "layer 1")  # tiled, not interleaved: not KV head h // 3


def test_new_architecture_falcon_calibrates_its_kv_heads_and_verifies(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    from fp8kv.data import DataRequest, load_calibration_data

    src = make_zoo_checkpoint("falcon", tmp_path / "src", overrides=NEW_FALCON)
    data = DataRequest(dataset=corpus(tmp_path), num_samples=3, seq_len=32)
    result = calibrate(CalibrationRequest(model=str(src), out=tmp_path / "out", data=data, batch_size=2,
                                          device="cpu", per_head=True))
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    expected = torch.zeros(2, 2, 2)  # [layer, K/V, kv_head]
    for sample in load_calibration_data(data, AutoTokenizer.from_pretrained(src)).samples:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([sample]), **cache_kwargs(model, cache))
        for layer in range(2):  # transformers up to 5.24 caches the 4 query heads' copies, 5.25 the 2 KV heads
            kv = torch.stack([fold_repeated_heads(cache.layers[layer].keys, 2, "K")[0],
                              fold_repeated_heads(cache.layers[layer].values, 2, "V")[0]])
            expected[layer] = torch.maximum(expected[layer], kv.abs().float().amax(dim=(2, 3)))
    assert torch.equal(result.table.amax, expected)

    verdict = CliRunner().invoke(app, ["verify", str(tmp_path / "out"), "--dataset", corpus(tmp_path),
                                       "--num-samples", "2", "--seq-len", "32", "--engine", "vllm-tpu", "--quiet"])
    assert verdict.exit_code in (ExitCode.PASS, ExitCode.WARN), verdict.output
    report = json.loads((tmp_path / "out" / "verify" / "report.json").read_text())
    assert report["fidelity"]["kl_mean"] <= report["fidelity"]["bound"], report["fidelity"]  # the runtime is the model


def test_a_checkpoint_transformers_cannot_run_is_an_error_naming_transformers(tmp_path) -> None:
    """gpt2 with 16 positions fails inside transformers on 32-token samples: the user's checkpoint, not fp8kv."""
    src = make_zoo_checkpoint("gpt2", tmp_path / "short", overrides={"n_positions": 16})
    result = CliRunner().invoke(app, ["calibrate", str(src), "--dataset", corpus(tmp_path), "--num-samples", "2",
                                      "--seq-len", "32", "--quiet"])
    assert result.exit_code == ExitCode.ERROR, result.output
    assert result.stderr.strip() == (
        f"fp8kv: error: {src}: transformers' own GPT2Model forward fails on this checkpoint (IndexError: index out "
        "of range in self); fp8kv calibrates and verifies only models transformers runs")
