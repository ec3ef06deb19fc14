"""The models fp8kv ships: the bundled default and its outlier variant (built by tools/train.py, tools/outliers.py)."""

from pathlib import Path

BUNDLED_DIR = Path(__file__).parent / "bundled"
BUNDLED_MODEL_DIR = BUNDLED_DIR / "model"
"""The bundled default model: a small Llama trained on Python's documentation (see tools/train.py)."""
BUNDLED_CALIBRATION_TEXT = BUNDLED_DIR / "data" / "calibration.jsonl"
"""Calibration split of the bundled model's corpus: JSON lines with a "text" field."""
BUNDLED_HELDOUT_TEXT = BUNDLED_DIR / "data" / "heldout.jsonl"
"""Held-out split (never trained on, never calibrated on): JSON lines with a "text" field."""
BUNDLED_MODEL_ALIAS = "bundled"
"""The MODEL argument that names the bundled model on the command line."""
BUNDLED_OUTLIERS_DIR = BUNDLED_DIR / "outliers"
"""The bundled model with a few K/V channels moved beyond fp8's range, same logits (see tools/outliers.py)."""
BUNDLED_OUTLIERS_ALIAS = "bundled-outliers"
"""The MODEL argument that names the bundled outlier model on the command line."""
