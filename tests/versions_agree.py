"""Two venvs' `fp8kv calibrate bundled` + `fp8kv verify` folders agree where no torch or transformers release may
move them: kv_scales.safetensors byte for byte, and every figure of verify's report.json but where it ran, how
long it took and the KL figures of its fidelity check. `make versions-agree` runs it on .venv's and .venv-newest's
folders.

    python tests/versions_agree.py FOLDER_A FOLDER_B
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import VERIFY_DIR
from fp8kv.checkpoint.conventions import SCALES_FILE
from fp8kv.verify.report import REPORT_JSON

# What differs by where and when verify ran, not by what it measured.
RUN_FIELDS = ("checkpoint", "timings_s")
# The fidelity check's figures are KLs against transformers' own forward, whose bf16 arithmetic a transformers or
# torch release may move: on an Intel Xeon with AMX, torch 2.9 and 2.15 put them 3 % apart while every figure of
# fp8kv's own runtime agreed to the bit. Its sample and token counts still must agree.
TRANSFORMERS_FIGURES = ("kl_mean", "kl_max", "noise", "bound")


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every path at which the two parsed JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(a.keys() | b.keys()) for d in differences(a.get(key), b.get(key), f"{where}.{key}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where or '.'}: {a!r} != {b!r}"]


def report(folder: Path) -> dict[str, Any]:
    parsed = json.loads((folder / VERIFY_DIR / REPORT_JSON).read_text())
    if parsed.get("fidelity"):
        parsed["fidelity"] = {k: v for k, v in parsed["fidelity"].items() if k not in TRANSFORMERS_FIGURES}
    return {k: v for k, v in parsed.items() if k not in RUN_FIELDS}


def main(a: Path, b: Path) -> int:
    found = []
    if (a / SCALES_FILE).read_bytes() != (b / SCALES_FILE).read_bytes():
        found.append(f"{SCALES_FILE}: the bytes differ")
    found += [f"{REPORT_JSON} {d}" for d in differences(report(a), report(b))]
    for line in found:
        print(f"{a} and {b} disagree: {line}", file=sys.stderr)
    if not found:
        print(f"{a} and {b} agree: {SCALES_FILE} byte for byte, every figure of {REPORT_JSON}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
