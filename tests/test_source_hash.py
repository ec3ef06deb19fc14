"""The source hash reuses the sha256 the Hugging Face cache names each weight blob by."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import fp8kv.checkpoint.source as source_module
from fp8kv.checkpoint.source import SourceCheckpoint


def _as_hub_cache(model: Path, root: Path) -> Path:
    """Lay `model` out like the hub cache: weights in blobs/<sha256>, the snapshot links to them."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model.iterdir():
        if file.suffix == ".safetensors":
            blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, blob)
            os.symlink(Path("../../blobs") / blob.name, snapshot / file.name)
        else:
            shutil.copyfile(file, snapshot / file.name)
    return snapshot


def test_cached_weights_are_hashed_by_their_blob_name(factory_checkpoint, tmp_path, monkeypatch) -> None:
    model = factory_checkpoint("llama")
    expected = SourceCheckpoint.open(model).content_hash()
    cached = SourceCheckpoint.open(_as_hub_cache(model, tmp_path / "hub"))
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr(source_module, "open", lambda path, *a, **k: opened.append(Path(path).name) or real_open(path, *a, **k),
                        raising=False)
    assert cached.content_hash() == expected
    assert "model.safetensors" not in opened and "config.json" in opened
