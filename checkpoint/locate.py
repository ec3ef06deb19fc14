"""Turn the MODEL argument into a local checkpoint folder."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from fp8kv.errors import Fp8kvError
from fp8kv.checkpoint.gguf import gguf_checkpoint, is_gguf
from fp8kv.checkpoint.hub_cache import is_repo_id, looks_like_hub_id, repo_id_from_cache_path, resolve_hub_model, split_hub_id
from fp8kv.checkpoint.artifacts import is_fp8kv_card
from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.models import (
    BUNDLED_CONTENT_HASHES, BUNDLED_MODEL_ALIAS, BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_ALIAS, BUNDLED_OUTLIERS_DIR,
)

BUNDLED_MODELS = {BUNDLED_MODEL_ALIAS: BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_ALIAS: BUNDLED_OUTLIERS_DIR}


def resolve_model(model: str) -> Path:
    """`bundled` / `bundled-outliers` -> a bundled model; a local folder -> itself; `org/name[@rev]` -> its Hub snapshot;
    a .gguf file or `smollm2` -> its dequantized safetensors folder in fp8kv's cache."""
    if model in BUNDLED_MODELS:
        folder = BUNDLED_MODELS[model]
        if not (folder / "config.json").is_file():
            raise Fp8kvError(f"{folder}: the bundled model {model!r} is not installed; pass a checkpoint folder")
        return folder
    if is_gguf(model):
        return gguf_checkpoint(model)
    if looks_like_hub_id(model):
        return resolve_hub_model(model)
    path = Path(model).expanduser()
    if path.is_file():
        raise Fp8kvError(f"{model}: is a file, not a folder; pass the checkpoint folder that holds config.json "
                         "(or a .gguf file)")
    if not path.is_dir():
        raise Fp8kvError(
            f"{model}: no such checkpoint folder (pass a local folder with config.json, 'bundled', or a Hub id org/name)"
        )
    return path


def infer_base_model(model: str, source: Path) -> str | None:
    """The Hub id the scales are for: MODEL as typed, the Hub cache folder's id, what an fp8kv source recorded,
    or the source config's `_name_or_path`; None when none of them is a Hub id."""
    if looks_like_hub_id(model):
        return split_hub_id(model)[0]
    record = read_provenance(source) if Path(source).is_dir() else None  # an fp8kv output keeps its base model
    config = _json_object(Path(source) / "config.json")
    candidates = [repo_id_from_cache_path(source), record.source.base_model if record and record.source else None,
                  config.get("_name_or_path")]
    return next((c for c in candidates if isinstance(c, str) and is_repo_id(c)), None)


def infer_license(*readmes: Path) -> str | None:
    """The `license` of the first of `readmes` (a source model's README.md) whose Hub metadata names one."""
    from huggingface_hub import metadata_load

    for readme in readmes:
        if not readme.is_file() or is_fp8kv_card(readme):
            continue
        try:
            value = (metadata_load(readme) or {}).get("license")
        except Exception:  # noqa: BLE001 - a malformed source card only means "license unknown"
            continue
        if isinstance(value, str) and value:
            return value
    return None


def bundled_name(path: str | Path) -> str | None:
    """`bundled` / `bundled-outliers` when `path` is a bundled model's folder, else None."""
    resolved = Path(path).resolve()
    return next((alias for alias, folder in BUNDLED_MODELS.items() if folder.resolve() == resolved), None)


def _json_object(path: Path) -> dict:
    """The JSON object in `path`; empty when it is absent or unreadable (it only adds a hint)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def verify_command(folder: Path) -> str:
    """The `fp8kv verify` line to suggest for `folder`: the bundled held-out text is its default only for the
    bundled models; any other gets text it writes itself."""
    text = "" if is_bundled_model(folder) else " --dataset generated"
    return f"fp8kv verify {shlex.quote(str(folder))}{text}"


def is_bundled_model(folder: Path) -> bool:
    """`folder` is a bundled model, or fp8kv's output from one: its fp8kv.json names one as source or converted
    folder, or records a source with a bundled model's content hash (calibrated by another install of fp8kv,
    whose bundled models live elsewhere)."""
    seen: set[Path] = set()
    current: Path | None = Path(folder).resolve()
    while current is not None and current not in seen:
        if bundled_name(current) is not None:
            return True
        seen.add(current)
        record = read_provenance(current) if current.is_dir() else None
        if record is None:
            return False
        if record.source is not None and record.source.content_hash in BUNDLED_CONTENT_HASHES:
            return True
        origin = record.source.path if record.source is not None else None
        if origin is None and record.converted_from is not None:
            origin = record.converted_from.path
        current = Path(origin).resolve() if origin else None
    return False
