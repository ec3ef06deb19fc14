"""End-to-end calibration on every factory architecture, against transformers' own KV cache."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from fp8kv.data import DataRequest, load_calibration_data
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.calibrate.scales import scale_from_amax
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE
from fp8kv.checkpoint.provenance import Provenance
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint
from fp8kv.transformers_cache import cache_kwargs

E4M3_MAX = 448.0


def data_request(corpus: str, num_samples: int = 6) -> DataRequest:
    return DataRequest(dataset=corpus, num_samples=num_samples, seq_len=60)


def cache_amax(model_dir, samples: list[list[int]]) -> torch.Tensor:
    """Independent reference: running max |K|, |V| as transformers' DynamicCache stores them.

    One sample at a time, no padding, the full causal LM. Returns float32 [layers, 2, kv_heads].
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    running = None
    with torch.no_grad():
        for sample in samples:
            cache = DynamicCache()  # no config: every layer keeps all its tokens
            model(input_ids=torch.tensor([sample]), **cache_kwargs(model, cache))
            amax = torch.stack(
                [torch.stack([layer.keys.abs().amax(dim=(0, 2, 3)), layer.values.abs().amax(dim=(0, 2, 3))])
                 for layer in cache.layers]
            )
            assert cache.layers[0].keys.shape[2] == len(sample)
            running = amax if running is None else torch.maximum(running, amax)
    return running.float()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scales_match_transformers_cache(arch, tmp_path, corpus):
    src = make_checkpoint(arch, tmp_path / arch)
    request = CalibrationRequest(model=str(src), data=data_request(corpus), batch_size=4, headroom=1.0)
    result = calibrate(request)
    samples = load_calibration_data(request.data, AutoTokenizer.from_pretrained(src)).samples
    reference = cache_amax(src, samples)  # [layers, 2, kv_heads]
    expected = (reference.amax(-1) / E4M3_MAX).float()  # [layers, 2]
    got = torch.tensor([[*result.scales.k[i], *result.scales.v[i]] for i in range(2)])
    torch.testing.assert_close(got, expected, rtol=3e-7, atol=0)
    assert (expected * E4M3_MAX).double().le(got.double() * E4M3_MAX + 0).all()
    # batches of 4 right-padded samples against one sample at a time: float32 matmuls may round differently
    torch.testing.assert_close(result.table.amax, reference, rtol=1e-6, atol=0)


def test_padding_never_enters_statistics(tmp_path, corpus):
    src = make_checkpoint("qwen3", tmp_path / "m")
    one = calibrate(CalibrationRequest(model=str(src), data=data_request(corpus), batch_size=1))
    padded = calibrate(CalibrationRequest(model=str(src), data=data_request(corpus), batch_size=6))
    torch.testing.assert_close(padded.table.amax, one.table.amax, rtol=1e-6, atol=0)
    assert padded.provenance.dataset.num_tokens == one.provenance.dataset.num_tokens


def test_all_zero_layer_refused_and_nothing_written(tmp_path, corpus):
    src = make_checkpoint("llama", tmp_path / "m")
    weights = load_file(src / "model.safetensors")
    for name in ("k_proj", "v_proj"):
        weights[f"model.layers.1.self_attn.{name}.weight"].zero_()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(Fp8kvError, match=r"all-zero K or V in layers \[1\].*--allow-unobserved"):
        calibrate(CalibrationRequest(model=str(src), out=out, data=data_request(corpus, 2)))
    assert not out.exists()
    result = calibrate(CalibrationRequest(model=str(src), out=out, data=data_request(corpus, 2), allow_unobserved=True))
    assert result.scales.k[1] == (1.0,) and result.scales.v[1] == (1.0,)
    assert result.scales.k[0][0] < 1.0 and result.table.defaulted == (1,)
    assert "layer 1" in result.warnings[0]


def test_sharded_overlay_links_weights_and_per_head_shapes(tmp_path, corpus):
    src = make_checkpoint("mistral", tmp_path / "m", num_kv_heads=2, max_shard_bytes=40_000)
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 1
    out = tmp_path / "out"
    result = calibrate(CalibrationRequest(model=str(src), out=out, data=data_request(corpus, 3), per_head=True,
                                          headroom=1.0))
    for name in shards:
        assert os.stat(out / name).st_ino == os.stat(src / name).st_ino
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    scale_file = index["model.layers.1.self_attn.k_scale"]
    with safe_open(out / scale_file, "pt") as f:
        k1 = f.get_tensor("model.layers.1.self_attn.k_scale")
    assert k1.shape == (2, 1, 1) and k1.dtype == torch.float32
    assert torch.equal(k1, result.scales.tensor("k", 1))
    amax_heads = result.table.amax[1, 0]  # [kv_heads]
    assert torch.equal(k1, scale_from_amax(amax_heads).reshape(2, 1, 1))  # the one formula, bit for bit
    torch.testing.assert_close(k1.flatten(), amax_heads / E4M3_MAX, rtol=3e-7, atol=0)  # nextafter: a step at most
    text = (out / PROVENANCE_FILE).read_text()
    provenance = Provenance.from_json(text)
    assert provenance.to_json() == text  # the round trip keeps every key, value and their order
    row = provenance.layers[1]
    assert row.k.scale_per_head == tuple(k1.flatten().tolist())
    assert row.k.scale == max(row.k.scale_per_head)
    assert provenance.per_head is True and provenance.source.content_hash.startswith("sha256:")
    config = json.loads((out / "config.json").read_text())
    assert config["compression_config"]["kv_cache_scheme"]["strategy"] == "attn_head"


def test_headroom_and_e5m2(tmp_path, corpus):
    src = make_checkpoint("llama", tmp_path / "m")
    base = calibrate(CalibrationRequest(model=str(src), data=data_request(corpus, 2)))
    other = calibrate(CalibrationRequest(model=str(src), data=data_request(corpus, 2), kv_dtype="fp8_e5m2", headroom=2.0))
    amax = base.table.amax.amax(-1)  # [layers, 2]
    got = torch.tensor([[*other.scales.k[i], *other.scales.v[i]] for i in range(2)])
    torch.testing.assert_close(got, amax / 57344.0 * 2.0, rtol=3e-7, atol=0)
