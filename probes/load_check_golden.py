"""What vLLM's own loader holds for fp8kv's outputs, through `load_check`, pinned as a golden file.

    probes/vllm_venv.sh                                 # once: bench/.vllm-venv with vLLM's CPU build
    .venv/bin/python probes/load_check_golden.py [--smollm2]

Cases: a tiny bf16 factory llama calibrated by fp8kv (compressed-tensors), the same folder with its scale
tensors removed (the negative control: the engine must hold 1.0), its `convert --to vllm-json` and
`--to modelopt` outputs, and with `--smollm2` the real SmolLM2-135M (the `demo` extra) calibrated the same way.
Each case is one load-check, timed; the golden file is named for the engine release:
tests/golden/<engine>-cpu-<version>-load.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fp8kv.calibrate.pipeline import calibrate
from fp8kv.calibrate.request import CalibrationRequest
from fp8kv.checkpoint.conventions import SCALES_FILE
from fp8kv.checkpoint.convert import convert_checkpoint
from fp8kv.checkpoint.source import INDEX_NAME
from fp8kv.data import DataRequest
from fp8kv.loadcheck.run import LoadCheckReport, load_check, to_json
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.tools.factory import make_checkpoint

REPO = Path(__file__).parent.parent
GOLDEN = REPO / "tests" / "golden"


def calibrated(source: str | Path, out: Path) -> Path:
    """`source` calibrated on the bundled calibration text (8 samples of 64 tokens), as compressed-tensors."""
    data = DataRequest(dataset=str(BUNDLED_CALIBRATION_TEXT), num_samples=8, seq_len=64)
    calibrate(CalibrationRequest(model=str(source), out=out, data=data, batch_size=4, device="cpu"))
    return out


def without_scales(folder: Path, out: Path) -> Path:
    """A copy of `folder` with its scale tensors' file gone and unlisted in the index; the config is kept."""
    shutil.copytree(folder, out)
    (out / SCALES_FILE).unlink()
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"] = {name: file for name, file in index["weight_map"].items() if file != SCALES_FILE}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return out


def cases(root: Path, smollm2: bool) -> dict[str, Path]:
    """Case name -> checkpoint folder."""
    import torch

    # vLLM's CPU attention takes head sizes from 32 up
    source = make_checkpoint("llama", root / "src", dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    base = calibrated(source, root / "compressed-tensors")
    found = {"compressed-tensors": base,
             "compressed-tensors, scale tensors removed": without_scales(base, root / "no-scales"),
             "vllm-json": convert_checkpoint(base, root / "vllm-json", "vllm-json"),
             "modelopt": convert_checkpoint(base, root / "modelopt", "modelopt")}
    if smollm2:
        found["smollm2 compressed-tensors"] = calibrated("smollm2", root / "smollm2")
    return found


def engine_python_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--engine", default="vllm")
    options.add_argument("--python", type=Path, default=REPO / "bench" / ".vllm-venv" / "bin" / "python")
    options.add_argument("--smollm2", action="store_true", help="add SmolLM2-135M (needs the demo extra)")
    args = options.parse_args()
    results: dict[str, tuple[LoadCheckReport, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in cases(Path(tmp), args.smollm2).items():
            start = time.perf_counter()
            report = load_check(folder, args.engine, args.python)
            results[name] = report, time.perf_counter() - start
            matching = sum(row.matches for row in report.layers)
            print(f"{name:<45} {matching}/{len(report.layers)} layers hold the file's value, "
                  f"{results[name][1]:.1f} s", flush=True)
    first = next(iter(results.values()))[0]
    provenance = {
        args.engine: first.engine_version, "torch": first.torch_version,
        "python": engine_python_version(args.python), "machine": platform.machine(), "cpus": os.cpu_count(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([".venv/bin/python", "probes/load_check_golden.py", *sys.argv[1:]]),
        "engine_python": str(args.python.relative_to(REPO) if args.python.is_relative_to(REPO)
                             else args.python),
    }
    golden = {"provenance": provenance, "cases": {
        name: {"wall_s": round(wall, 1), "ok": report.ok,
               "report": {**json.loads(to_json(report)), "checkpoint": name}} for name, (report, wall) in results.items()}}
    GOLDEN.mkdir(parents=True, exist_ok=True)
    out = GOLDEN / f"{args.engine}-cpu-{first.engine_version}-load.json"
    out.write_text(json.dumps(golden, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
