"""Small C kernels each process builds on first use with the system's C compiler (`$CC`, else `cc`) and loads with
ctypes: `build`. Where one does not build or load, its caller runs torch instead, the same bits."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def build(source: Path, function: str, flags: Sequence[str], argtypes: Sequence[Any]) -> tuple[Any, str]:
    """`function` of `source` compiled with `flags` (and -shared -fPIC), as a ctypes function taking `argtypes` and
    returning nothing (None where it did not build or load), and "built" or why not. Each process builds its own (a
    fraction of a second) in a private temporary folder, gone before the function runs: nothing is written anywhere
    else, and no library another process could have replaced is ever loaded."""
    compiler = os.environ.get("CC") or "cc"
    command = [compiler, *flags, "-shared", "-fPIC"]
    with tempfile.TemporaryDirectory(prefix=f"fp8kv-{source.stem.replace('_', '-')}-") as scratch:
        library = Path(scratch) / f"{source.stem}.so"
        try:
            subprocess.run([*command, "-o", str(library), str(source)], check=True, capture_output=True, timeout=120)
            loaded = getattr(ctypes.CDLL(str(library)), function)  # stays mapped once its file is gone
        except (OSError, AttributeError, subprocess.SubprocessError) as error:
            return None, f"{' '.join(command)}: {_reason(error)}"
    loaded.argtypes, loaded.restype = list(argtypes), None
    return loaded, "built"


def route(built: tuple[Any, str]) -> str:
    """What runs where a caller takes `build`'s result: the compiled kernel, or torch and why."""
    function, how = built
    return "compiled kernel" if function is not None else f"torch ({how})"


def _reason(error: OSError | AttributeError | subprocess.SubprocessError) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        lines = (error.stderr or b"").decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit {error.returncode}"
    return str(error)
