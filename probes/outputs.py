"""What the probes that run in an engine's venv share: their JSON output (moved here from bench/common.py with them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """A script's whole result to `path` (its --out; nothing where None), for the scripts that run in an engine's
    venv, where bench/common.py's write_results would import the engine's torch."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def emit_json(path: Path | None, result: dict[str, Any]) -> None:
    """A script's whole result to `path` where given (its --out), else to stdout as one line of JSON."""
    if path is None:
        print(json.dumps(result))
    write_json(path, result)
