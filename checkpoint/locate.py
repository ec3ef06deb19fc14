"""Turn the MODEL argument into a local checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from fp8kv.errors import Fp8kvError
from fp8kv.checkpoint.hub_cache import is_repo_id, looks_like_hub_id, repo_id_from_cache_path, resolve_hub_model, split_hub_id
from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.models import BUNDLED_MODEL_ALIAS, BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_ALIAS, BUNDLED_OUTLIERS_DIR

BUNDLED_MODELS = {BUNDLED_MODEL_ALIAS: BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_ALIAS: BUNDLED_OUTLIERS_DIR}


def resolve_model(model: str) -> Path:
    """`bundled` / `bundled-outliers` -> a bundled model; a local folder -> itself; `org/name[@rev]` -> its Hub snapshot."""
    if model in BUNDLED_MODELS:
        folder = BUNDLED_MODELS[model]
        if not (folder / "config.json").is_file():
            raise Fp8kvError(f"{folder}: the bundled model {model!r} is not installed; pass a checkpoint folder")
        return folder
    if looks_like_hub_id(model):
        return resolve_hub_model(model)
    path = Path(model).expanduser()
    if path.is_file():
        raise Fp8kvError(f"{model}: is a file, not a folder; pass the checkpoint folder that holds config.json")
    if not path.is_dir():
        raise Fp8kvError(
            f"{model}: no such checkpoint folder (pass a local folder with config.json, 'bundled', or a Hub id org/name)"
        )
    return path


def infer_base_model(model: str, source: Path) -> str | None:
    """The Hub id the scales are for: MODEL as typed, the Hub cache folder's id, or what an fp8kv source recorded."""
    if looks_like_hub_id(model):
        return split_hub_id(model)[0]
    cached = repo_id_from_cache_path(source)
    if cached:
        return cached
    record = read_provenance(source)  # calibrating or converting an fp8kv output keeps its base model
    recorded = record.source.base_model if record is not None and record.source is not None else None
    return recorded if recorded is not None and is_repo_id(recorded) else None
