"""Hub ids as MODEL: resolved offline from a cache folder in huggingface_hub's layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from fp8kv.errors import Fp8kvError
from fp8kv.checkpoint.hub_cache import ALLOW_PATTERNS, looks_like_hub_id, repo_id_from_cache_path, resolve_hub_model, split_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, source_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_CACHE with org/tiny at COMMIT (refs/main points at it); offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    shutil.copytree(source_model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_from_the_cache(hub_cache: Path) -> None:
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve_hub_model("org/tiny") == snapshot
    assert resolve_hub_model(f"org/tiny@{COMMIT}") == snapshot
    assert (resolve_hub_model("org/tiny") / "model.safetensors").is_file()


def test_uncached_model_offline_says_how_to_download(hub_cache: Path) -> None:
    with pytest.raises(Fp8kvError) as info:
        resolve_hub_model("org/other")
    assert str(info.value) == (
        "org/other: not in the local Hub cache and HF_HUB_OFFLINE is set; download it with "
        "`hf download org/other` (or `huggingface-cli download org/other`), then run again"
    )


def test_uncached_revision_offline_names_the_revision(hub_cache: Path) -> None:
    with pytest.raises(Fp8kvError, match=r"^org/tiny@v2: not in the local Hub cache .*`hf download org/tiny --revision v2`"):
        resolve_hub_model("org/tiny@v2")


def test_snapshot_without_safetensors_is_refused(hub_cache: Path) -> None:
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    (snapshot / "model.safetensors").unlink()
    (snapshot / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(Fp8kvError, match=r"^org/tiny: the Hub snapshot at .* has no \*\.safetensors weights"):
        resolve_hub_model("org/tiny")


def test_only_safetensors_json_and_tokenizer_files_are_fetched() -> None:
    names = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json",
             "tokenizer_config.json", "tokenizer.model", "merges.txt", "chat_template.jinja", "README.md",
             "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "model.pt", "original/consolidated.00.pth",
             "flax_model.msgpack", "modeling_custom.py"]
    kept = set(filter_repo_objects(names, allow_patterns=ALLOW_PATTERNS))
    assert kept == set(names[:9])


def test_hub_id_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_hub_id("org/name@rev") == ("org/name", "rev")
    assert split_hub_id("org/name") == ("org/name", None)
    assert looks_like_hub_id("meta-llama/Llama-3.1-8B") and looks_like_hub_id("org/name@main")
    assert not looks_like_hub_id("bundled") and not looks_like_hub_id("/abs/path/model")
    assert not looks_like_hub_id("a/b/c")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not looks_like_hub_id("org/local")  # an existing folder wins over a Hub id
    assert repo_id_from_cache_path(f"/c/models--Qwen--Qwen3-8B/snapshots/{COMMIT}") == "Qwen/Qwen3-8B"
    assert repo_id_from_cache_path("/models/Qwen3-8B") is None
