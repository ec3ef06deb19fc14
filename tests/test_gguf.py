"""A GGUF file as MODEL: dequantized by transformers once into a cached safetensors folder, then calibrated
like any checkpoint. The GGUF is written here with the gguf package's own writer (no download)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fp8kv.checkpoint.gguf import GgufOrigin, gguf_checkpoint, read_origin
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint


_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert script interleaves the rotary halves of Q and K per head; transformers undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def write_llama_gguf(src: Path, path: Path) -> None:
    """The factory llama checkpoint `src` as a float32 GGUF file, tokenizer and chat template included."""
    from transformers import AutoTokenizer

    config = json.loads((src / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(src)
    state = load_file(src / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i < 4 else gguf.TokenType.NORMAL for i in range(len(vocab))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, tensor in state.items():
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}.get(name)
        if gguf_name is None:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part = _LAYER_NAMES[rest.removesuffix(".weight")]
            gguf_name = f"blk.{layer}.{part}.weight"
            tensor = _permute(tensor, heads[part]) if part in heads else tensor
        writer.add_tensor(gguf_name, tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture()
def llama_gguf(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the factory llama folder, its GGUF file); fp8kv's cache in tmp_path."""
    monkeypatch.setenv("FP8KV_CACHE", str(tmp_path / "cache"))
    src = make_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(src, path)
    return src, path


def test_a_gguf_becomes_a_cached_safetensors_folder_once(llama_gguf, tmp_path) -> None:
    src, path = llama_gguf
    before = path.read_bytes()
    folder = gguf_checkpoint(str(path))
    digest = hashlib.sha256(before).hexdigest()
    assert folder == tmp_path / "cache" / "gguf" / f"tiny-llama-{digest[:16]}"
    import transformers

    assert read_origin(folder) == GgufOrigin("tiny-llama.gguf", digest, len(before), None, transformers.__version__)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    converted, original = load_file(folder / "model.safetensors"), load_file(src / "model.safetensors")
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[name], original[name]) for name in original)  # bf16 -> f32 -> bf16 is exact
    weights = folder / "model.safetensors"
    assert all(saved.stat().st_mode & 0o777 == 0o644 for saved in folder.iterdir())  # outputs hard-link these
    weights.chmod(0o600)  # as folders converted before fp8kv set the modes are
    stamp = weights.stat().st_mtime_ns
    assert gguf_checkpoint(str(path)) == folder and weights.stat().st_mtime_ns == stamp
    assert weights.stat().st_mode & 0o777 == 0o644
    assert path.read_bytes() == before  # the user's file is never touched


def test_calibrate_takes_a_gguf_file_and_writes_a_safetensors_checkpoint(llama_gguf, tmp_path, corpus) -> None:
    _, path = llama_gguf
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["calibrate", str(path), "--out", str(out), "--dataset", corpus,
                                      "--num-samples", "4", "--seq-len", "32", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "GGUF tensors" not in result.output  # transformers' own bar shows only with -v
    assert any(out.glob("model*.safetensors")) and (out / "kv_scales.safetensors").is_file()
    assert all(weights.stat().st_mode & 0o044 == 0o044 for weights in out.glob("model*.safetensors"))
    assert read_origin(out).file == "tiny-llama.gguf"  # the GGUF it came from travels with the weights
    scales = read_kv_scales(out).scales
    assert scales is not None and sorted(scales.k) == [0, 1]


def test_a_file_transformers_cannot_read_as_gguf_is_one_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FP8KV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(Fp8kvError, match=rf"^{path}: transformers cannot read this GGUF \("):
        gguf_checkpoint(str(path))
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
