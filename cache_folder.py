"""fp8kv's own cache folder: converted GGUF models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$FP8KV_CACHE`, else `$XDG_CACHE_HOME/fp8kv`, else `~/.cache/fp8kv`."""
    if os.environ.get("FP8KV_CACHE"):
        return Path(os.environ["FP8KV_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fp8kv"
