"""fp8kv's calibrated output loads in plain transformers and computes exactly what its source computes.

The KV-only compressed-tensors block sits under `compression_config`, which transformers never reads,
so no compressed-tensors quantizer runs on load (it fails on per-expert MoE weights and on configs whose
head counts are not top-level); the scale tensors are reported as unexpected keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.load import model_class
from fp8kv.data import DataRequest
from fp8kv.geometry import read_config
from fp8kv.tools.factory import make_checkpoint
from fp8kv.tools.zoo import make_zoo_checkpoint
from fp8kv.tools.zoo_matrix import NUM_SAMPLES, SEQ_LEN, corpus

# A dense model, a per-expert MoE, one without num_key_value_heads (opt), a vision-language wrapper
# (head counts in text_config) and per-layer head dims (gemma4): each once failed to load.
ARCHITECTURES = ("llama", "mixtral", "opt", "llava", "gemma4_text")


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = model_class(read_config(model_dir)).from_pretrained(model_dir)
    assert not hasattr(model.config, "quantization_config")
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_calibrated_output_loads_in_transformers_with_the_sources_logits(model_type: str, tmp_path) -> None:
    build = make_checkpoint if model_type == "llama" else make_zoo_checkpoint
    src = build(model_type, tmp_path / "src")
    data = DataRequest(dataset=corpus(tmp_path), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "out", data=data, batch_size=1, device="cpu"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["compression_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    ids = torch.tensor([[3, 17, 5, 29, 11, 8]])
    assert torch.equal(_logits(tmp_path / "out", ids), _logits(src, ids))


@pytest.mark.parametrize("convention", ["quark", "modelopt", "vllm-json"])
def test_every_conventions_kv_only_output_loads_in_transformers(convention: str, tmp_path) -> None:
    """Quark's KV-only block also sits under compression_config: under quantization_config transformers
    would refuse to load without the Quark library installed."""
    src = make_checkpoint("llama", tmp_path / "src")
    data = DataRequest(dataset=corpus(tmp_path), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "out", data=data, batch_size=1, device="cpu",
                                 convention=convention))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    if convention == "quark":
        assert config["compression_config"]["quant_method"] == "quark"
    ids = torch.tensor([[3, 17, 5, 29, 11, 8]])
    assert torch.equal(_logits(tmp_path / "out", ids), _logits(src, ids))
