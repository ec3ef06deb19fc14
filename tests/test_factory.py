"""The test-model factory and the bundled default model load and run with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8kv.geometry import AttentionGeometry
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint
from fp8kv.tools.train import perplexity

PROMPT = "The for statement is used to iterate over the elements of a sequence."


def _logits(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits  # [1, T, vocab]


def _kv_rows(model_dir: Path) -> dict[str, int]:
    """Output rows of each layer's K (or fused QKV) projection, read from the safetensors."""
    rows = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if name.endswith(("k_proj.weight", "qkv_proj.weight")):
                    rows[name] = f.get_slice(name).get_shape()[0]
    return rows


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_factory_checkpoint_loads_and_runs(arch: str, factory_checkpoint) -> None:
    path = factory_checkpoint(arch)
    geometry = AttentionGeometry.from_dir(path)
    logits = _logits(path)
    prompt_tokens = len(AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"])
    assert logits.shape == (1, prompt_tokens, geometry.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not a constant output


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_factory_checkpoint_uses_gqa(arch: str, factory_checkpoint) -> None:
    path = factory_checkpoint(arch)
    geometry = AttentionGeometry.from_dir(path)
    assert geometry.num_kv_heads < geometry.num_heads
    assert geometry.num_layers == 2
    # The weights really have num_kv_heads K heads, not a repeated (MHA) layout.
    fused = (geometry.num_heads + 2 * geometry.num_kv_heads) * geometry.head_dim
    expected = fused if arch == "phi3" else geometry.num_kv_heads * geometry.head_dim
    rows = _kv_rows(path)
    assert len(rows) == geometry.num_layers
    assert set(rows.values()) == {expected}


def test_factory_arch_specifics(factory_checkpoint) -> None:
    gemma2 = json.loads((factory_checkpoint("gemma2") / "config.json").read_text())
    assert gemma2["attn_logit_softcapping"] == 50.0
    gemma2_layers = AttentionGeometry.from_dir(factory_checkpoint("gemma2")).layer_types
    assert "sliding_attention" in gemma2_layers
    for arch in ("qwen3", "gemma3"):
        with safe_open(factory_checkpoint(arch) / "model.safetensors", "pt") as f:
            assert "model.layers.0.self_attn.k_norm.weight" in set(f.keys())


def test_factory_sharded_checkpoint_matches_single_file(tmp_path: Path, factory_checkpoint) -> None:
    sharded = make_checkpoint("llama", tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert torch.equal(_logits(sharded), _logits(factory_checkpoint("llama")))


def test_factory_dtype_and_size_options(tmp_path: Path) -> None:
    path = make_checkpoint(
        "qwen2", tmp_path / "m", dtype=torch.bfloat16, num_layers=3, hidden_size=96, vocab_size=1000
    )
    with safe_open(path / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        embedding_shape = f.get_slice("model.embed_tokens.weight").get_shape()
    assert dtypes == {"BF16"}
    assert embedding_shape == [1000, 96]
    geometry = AttentionGeometry.from_dir(path)
    assert (geometry.num_layers, geometry.hidden_size, geometry.vocab_size) == (3, 96, 1000)
    assert torch.isfinite(_logits(path, torch.bfloat16)).all()


def test_factory_tokenizer_has_chat_template(factory_checkpoint) -> None:
    tokenizer = AutoTokenizer.from_pretrained(factory_checkpoint("mistral"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def _jsonl_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_bundled_model_shape_and_files() -> None:
    geometry = AttentionGeometry.from_dir(BUNDLED_MODEL_DIR)
    config = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads) == (4, 8, 2)
    assert (geometry.head_dim, geometry.hidden_size, geometry.vocab_size) == (32, 256, 2048)
    total = sum(p.stat().st_size for p in BUNDLED_MODEL_DIR.parent.rglob("*") if p.is_file())
    assert total < 30 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    assert len(tokenizer) == geometry.vocab_size
    assert tokenizer.chat_template


def test_bundled_splits_are_disjoint_records() -> None:
    calibration = _jsonl_texts(BUNDLED_CALIBRATION_TEXT)
    heldout = _jsonl_texts(BUNDLED_HELDOUT_TEXT)
    assert len(calibration) >= 50 and len(heldout) >= 50
    assert not set(calibration) & set(heldout)
    assert all(300 <= len(text) <= 2000 for text in calibration + heldout)


def test_bundled_model_is_a_language_model() -> None:
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    ppl = perplexity(model, tokenizer, _jsonl_texts(BUNDLED_HELDOUT_TEXT)[:6])
    # A uniform guess scores len(tokenizer) = 2048; the shipped model is far better.
    assert ppl < len(tokenizer) / 20
