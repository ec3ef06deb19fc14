"""Models fp8kv ships (the bundled default) and builds (the test factory)."""

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).parent / "bundled" / "model"
"""The bundled default model: a small Llama trained on Python's documentation (see models/train.py)."""
