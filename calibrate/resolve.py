"""Turn the MODEL argument into a local checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from fp8kv.errors import Fp8kvError
from fp8kv.hub.resolve import looks_like_hub_id, resolve_hub_model
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
    if not path.is_dir():
        raise Fp8kvError(
            f"{model}: no such checkpoint folder (pass a local folder with config.json, 'bundled', or a Hub id org/name)"
        )
    return path
