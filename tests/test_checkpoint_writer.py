"""The overlay writer and the source reader: links, atomicity, untouched sources, refusals."""

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
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.provenance import Provenance, file_digest, folder_files, read_provenance
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint

SCALES = KVScales.from_floats({0: 0.01, 1: 0.02}, {0: 0.03, 1: 0.04})
RECORD = Provenance(version="0.1.0", command=None, format="compressed-tensors")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("src") / "qwen3", max_shard_bytes=40_000)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("src") / "llama")


def test_overlay_links_weights_and_leaves_source_untouched(sharded, tmp_path):
    before = SourceCheckpoint.open(sharded).content_hash()
    source = SourceCheckpoint.open(sharded)
    assert len(source.weight_files) > 1
    out = write_checkpoint(sharded, tmp_path / "out", SCALES, record=RECORD)
    for name in source.weight_files:
        assert os.stat(out / name).st_ino == os.stat(sharded / name).st_ino
    assert SourceCheckpoint.open(sharded).content_hash() == before
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.1.self_attn.v_scale"] == "kv_scales.safetensors"
    assert {k: v for k, v in index.items() if "_scale" not in k} == source.weight_map
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (sharded / name).read_bytes()
    written = read_provenance(out)
    assert replace(written, files=None, geometry=None) == RECORD and written.geometry == source.geometry
    assert dict(written.files) == {name: file_digest(out / name) for name in folder_files(out)}
    assert PROVENANCE_FILE not in dict(written.files) and "kv_scales.safetensors" in dict(written.files)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_copy_mode_writes_real_copies(single, tmp_path):
    out = write_checkpoint(single, tmp_path / "out", SCALES, mode="copy")
    copied = out / "model-00001-of-00001.safetensors"
    assert os.stat(copied).st_ino != os.stat(single / "model.safetensors").st_ino
    assert copied.read_bytes() == (single / "model.safetensors").read_bytes()


def test_written_checkpoint_loads_in_transformers_as_the_plain_model(single, tmp_path):
    from transformers import AutoModelForCausalLM

    out = write_checkpoint(single, tmp_path / "out", SCALES)
    assert not (out / "model.safetensors").exists()  # transformers would pick it and skip the index
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["compression_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    model, source = (AutoModelForCausalLM.from_pretrained(path) for path in (out, single))
    assert not hasattr(model.config, "quantization_config")  # no compressed-tensors quantizer ran
    assert "model.layers.0.self_attn.k_scale" not in dict(model.named_parameters())
    ids = torch.tensor([[1, 7, 3, 9, 4]])
    assert torch.equal(model(ids).logits, source(ids).logits)


def test_existing_output_refused_then_replaced_with_overwrite(single, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    foreign = r"out: holds files fp8kv did not write \(keep.txt\); --overwrite replaces only what fp8kv wrote there"
    with pytest.raises(Fp8kvError, match=foreign):  # no advice to pass --overwrite, which would refuse too
        write_checkpoint(single, out, SCALES)
    with pytest.raises(Fp8kvError, match=foreign):
        write_checkpoint(single, out, SCALES, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # a folder fp8kv never wrote is never deleted
    (out / "keep.txt").unlink()
    with pytest.raises(Fp8kvError, match=r"out: already exists; pass --overwrite to replace it$"):
        write_checkpoint(single, out, SCALES)
    write_checkpoint(single, out, SCALES, overwrite=True, record=RECORD)  # empty: allowed
    write_checkpoint(single, out, SCALES, overwrite=True, record=RECORD)  # only fp8kv's files, unchanged: replaced
    assert (out / "kv_scales.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_keeps_a_users_notes_and_edits(single, tmp_path):
    out = write_checkpoint(single, tmp_path / "out", SCALES, record=RECORD)
    (out / "MY_NOTES.txt").write_text("the user's notes")
    with pytest.raises(Fp8kvError, match=r"holds files fp8kv did not write \(MY_NOTES.txt\)"):
        write_checkpoint(single, out, SCALES, overwrite=True, record=RECORD)
    assert (out / "MY_NOTES.txt").read_text() == "the user's notes"
    (out / "MY_NOTES.txt").unlink()
    (out / "tokenizer_config.json").write_text("{}")  # a file fp8kv wrote, edited by the user
    with pytest.raises(Fp8kvError, match=r"holds files fp8kv wrote that were changed since \(tokenizer_config.json\)"):
        write_checkpoint(single, out, SCALES, overwrite=True, record=RECORD)
    assert (out / "tokenizer_config.json").read_text() == "{}"


def test_failed_write_leaves_nothing_and_stale_temp_folders_are_cleaned(single, tmp_path):
    stale = tmp_path / ".out.fp8kv-tmp-999999999"
    stale.mkdir()
    with pytest.raises(Fp8kvError, match="missing \\[1\\]"):
        write_checkpoint(single, tmp_path / "out", KVScales.from_floats({0: 0.1}, {0: 0.1}))
    assert not (tmp_path / "out").exists()
    write_checkpoint(single, tmp_path / "out", SCALES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_inside_source_is_refused(single):
    with pytest.raises(Fp8kvError, match="must not be inside the source checkpoint"):
        write_checkpoint(single, single / "calibrated", SCALES)
    assert not (single / "calibrated").exists()


def test_source_with_only_pickle_weights_is_refused_without_loading(tmp_path, single):
    src = tmp_path / "pickle"
    src.mkdir()
    shutil.copy(single / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(Fp8kvError, match=r"only pickle weights found \(pytorch_model.bin\); fp8kv never loads"):
        SourceCheckpoint.open(src)


def test_missing_and_empty_folders_are_one_clear_error(tmp_path):
    with pytest.raises(Fp8kvError, match="no such checkpoint folder"):
        SourceCheckpoint.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Fp8kvError, match="the folder is empty"):
        SourceCheckpoint.open(tmp_path / "empty")


def test_index_escaping_the_folder_is_refused(sharded, tmp_path):
    src = shutil.copytree(sharded, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../secret.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Fp8kvError, match="weight file '../secret.safetensors' escapes the checkpoint folder"):
        SourceCheckpoint.open(src)


def test_symlink_pointing_outside_is_refused(single, tmp_path):
    src = shutil.copytree(single, tmp_path / "src")
    (tmp_path / "elsewhere.txt").write_text("x")
    (src / "notes.txt").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(Fp8kvError, match="notes.txt: symlink points outside the checkpoint folder"):
        SourceCheckpoint.open(src)


def test_oversized_header_length_is_refused_before_reading(single, tmp_path):
    src = shutil.copytree(single, tmp_path / "src")
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(Fp8kvError, match="header claims 1099511627776 bytes"):
        SourceCheckpoint.open(src)


def test_weight_file_holding_old_scales_is_rewritten_without_them_bytewise(single, tmp_path):
    from safetensors.torch import load_file

    src = shutil.copytree(single, tmp_path / "src")
    weights = load_file(src / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.k_scale": torch.tensor([9.0])}, src / "model.safetensors")
    out = write_checkpoint(src, tmp_path / "out", SCALES)
    rewritten = load_file(out / "model-00001-of-00001.safetensors")
    assert rewritten.keys() == weights.keys()
    assert all(torch.equal(rewritten[k], weights[k]) for k in weights)


def test_content_hash_changes_with_any_byte(single, tmp_path):
    src = shutil.copytree(single, tmp_path / "src")
    first = SourceCheckpoint.open(src).content_hash()
    assert first == SourceCheckpoint.open(single).content_hash() and first.startswith("sha256:")
    (src / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text() + " ")
    assert SourceCheckpoint.open(src).content_hash() != first
