"""Turn the MODEL argument into a local checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from fp8kv.errors import Fp8kvError
from fp8kv.hub.resolve import looks_like_hub_id, resolve_hub_model
from fp8kv.models import BUNDLED_MODEL_ALIAS, BUNDLED_MODEL_DIR


def resolve_model(model: str) -> Path:
    """`bundled` -> the bundled model; a local folder -> itself; `org/name[@rev]` -> its Hub snapshot."""
    if model == BUNDLED_MODEL_ALIAS:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise Fp8kvError(f"{BUNDLED_MODEL_DIR}: the bundled model is not installed; pass a checkpoint folder")
        return BUNDLED_MODEL_DIR
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
