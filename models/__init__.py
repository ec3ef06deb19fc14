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
BUNDLED_CONTENT_HASHES = frozenset({
    "sha256:56990f18145bccc6255b360436510d5330951575c6f80a69252448499dc0b8b6",  # model
    "sha256:c80bbb319b25b94252f6d11407a86ce83abca51b8542d725f5eab99a36123e85",  # outliers
})
"""Each bundled model's content hash (`SourceCheckpoint.content_hash`): how an fp8kv.json written by another
install, whose bundled models live in another folder, still names one. tests/test_calibration_text.py keeps
them current."""
