"""A calibrated output folder, built by hand on a factory model, in the layout calibrate and verify write."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8kv.checkpoint.artifacts import PROVENANCE_FILE
from fp8kv.checkpoint.provenance import (
    CacheRecord, DatasetRecord, LayerRecord, Provenance, SourceRecord, file_digest, folder_files, record_written,
)
from fp8kv.checks import WARN, Finding
from fp8kv.verify.engines import PASS
from fp8kv.verify.report import HeldOut, VerifyReport
from fp8kv.verify.results import Accuracy, EngineResult, GenerationMatch, LayerCheck, PairedDifference
from tests.reports import report_for, write_report as write_report_file


FAKE_TOKEN = "hf_fakeTokenForFp8kvTests0123456789"
SOURCE_README = "---\nlicense: llama3.1\n---\n\n# The source model's own card\n"


def _cache(amax: float, scale: float, saturation: float) -> CacheRecord:
    return CacheRecord(amax=amax, clip=amax, scale=scale, saturation=saturation, amax_per_head=(amax,))


LAYERS = (
    LayerRecord(0, 1.0, k=_cache(1.25, 0.00279018, 0.0), v=_cache(0.75, 0.00167411, 0.0)),
    LayerRecord(1, 1.0, k=_cache(3.5, 0.0078125, 0.00042), v=_cache(0.5, 0.00111607, 0.0)),
)


@pytest.fixture(scope="session")
def source_model(tmp_path_factory: pytest.TempPathFactory, factory_checkpoint) -> Path:
    """The suite's 2-layer llama plus a README that carries a license, as a Hub model would."""
    path = shutil.copytree(factory_checkpoint("llama"), tmp_path_factory.mktemp("source") / "llama")
    (path / "README.md").write_text(SOURCE_README, encoding="utf-8")
    return path


def provenance(source: Path) -> Provenance:
    """The record calibrate would write for `source` (512 ultrachat samples, amax, the two LAYERS)."""
    return Provenance(
        version="0.1.0", command=f"fp8kv calibrate {source} --out DIR --num-samples 512", format="compressed-tensors",
        source=SourceRecord(path=str(source), content_hash="sha256:" + "9f2c" * 16, base_model=None),
        dataset=DatasetRecord("HuggingFaceH4/ultrachat_200k", "train_sft", "messages", num_samples=512,
                              num_tokens=512 * 2048, seq_len=2048, seed=42, note=None),
        strategy="amax", headroom=1.0, kv_dtype="fp8_e4m3", fp8_max=448.0, per_head=False, skipped_layers=(),
        defaulted_layers=(), layers=LAYERS,
    )



@pytest.fixture
def calibrated_dir(tmp_path: Path, source_model: Path) -> Path:
    """DIR as calibrate leaves it: hard-linked weights and README, scales file, index, config, fp8kv.json."""
    out = tmp_path / "out"
    out.mkdir()
    for name in os.listdir(source_model):
        if name == "config.json":
            continue
        if name.endswith(".safetensors") or name == "README.md":
            os.link(source_model / name, out / name)
        else:
            shutil.copy2(source_model / name, out / name)
    scales = {f"model.layers.{row.layer}.self_attn.{kv}_scale": torch.tensor([cache.scale])
              for row in LAYERS for kv, cache in (("k", row.k), ("v", row.v))}
    save_file(scales, out / "kv_scales.safetensors")
    weight_map = {name: "kv_scales.safetensors" for name in scales}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source_model / "config.json").read_text())
    config["compression_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
    (out / "config.json").write_text(json.dumps(config))
    files = tuple((name, file_digest(out / name)) for name in folder_files(out))  # what calibrate records
    (out / PROVENANCE_FILE).write_text(replace(provenance(source_model), files=files).to_json())
    return out


@pytest.fixture
def write_report():
    """A function writing verify/report.json (and the plot) as verify does, with `changes` applied."""
    return _write_report


@pytest.fixture
def verified_dir(calibrated_dir: Path) -> Path:
    """The calibrated folder after a WARN verify."""
    _write_report(calibrated_dir)
    return calibrated_dir


@pytest.fixture
def fake_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """A token in the environment, where huggingface_hub looks first."""
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    return FAKE_TOKEN


def report(out: Path) -> VerifyReport:
    """A WARN verify of `out` over 16 held-out samples, with its digest as it is now."""
    return report_for(
        out, (Finding(WARN, "layer 1 K saturation 0.042%"),), HeldOut(
            text_source="bundled heldout", num_samples=16, num_tokens=4096,
            accuracy=Accuracy(ppl_bf16=10.137, ppl_fp8=10.2461, ppl_fp8_unit=10.9133, kl_mean=0.00123, kl_max=0.0345,
                              top1_agreement=0.9876, kl_mean_unit=0.0021, kl_max_unit=0.051, top1_agreement_unit=0.981),
            layers=(LayerCheck(0, k_max_ratio=301.2, v_max_ratio=250.0, k_saturation=0.0, v_saturation=0.0,
                               nan_with_clamp=0),
                    LayerCheck(1, k_max_ratio=417.5, v_max_ratio=212.25, k_saturation=0.00042, v_saturation=0.0,
                               nan_with_clamp=0)),
            generation=GenerationMatch(prefill_match=1.0, decode_match=1.0, prefix_match=0.75),
            engines=(EngineResult("vllm-cuda", 10.2461, 0, 4096, 0, 16, None, "vLLM main, quant_utils.cuh", PASS),
                     EngineResult("sglang@0.5.23", 10.2302, 0, 4096, 0, 16, None, "SGLang 0.5.23, memory_pool.py", PASS,
                                  known_by="its own loader run here", accuracy=Accuracy(
                                      ppl_bf16=10.137, ppl_fp8=10.2302, ppl_fp8_unit=10.9133, kl_mean=0.00131,
                                      kl_max=0.0351, top1_agreement=0.9871, kl_mean_unit=0.0021, kl_max_unit=0.051,
                                      top1_agreement_unit=0.981, versus_unit=(PairedDifference(
                                          "kl_mean", 0.00131, 0.0021, -0.00079, -0.00101, -0.00058, 16, 4096, 1.0),)))),
        ),
    )


def _write_report(out: Path, **changes) -> Path:
    path = write_report_file(out, replace(report(out), **changes))
    (path.parent / "scales.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    (path.parent / "report.md").write_text("# verify\n")
    record_written(path.parent / "scales.png", path.parent / "report.md")
    return path
