"""What vLLM's published packages do with fp8 KV scales, read from the packages themselves (no install).

Downloads each release's wheel or source archive from the package index (`pip download --no-deps`) and records,
from its own files, what decides fp8kv's vLLM engine models:

- `vllm-tpu`: the torch its wheel pins, whether it depends on tpu-inference (whose platform then replaces vLLM's
  own TPU backend), and what its own torch_xla backend's cache write does with k_scale;
- `vllm` (the CUDA build): the torch it pins, the Triton cache write's division and whether the KV-cache method
  takes per-tensor scales only.

    .venv/bin/python probes/probe_vllm_packages.py            # rewrites tests/golden/vllm-releases.json

The CUDA kernels are compiled into the wheel; their source is read at a commit (configs/engines.toml says which).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "tests" / "golden" / "vllm-releases.json"
TPU_RELEASES = ("0.9.3", "0.10.1.1", "0.11.1", "0.12.0", "0.13.3", "0.32.0")
CUDA_RELEASES = ("0.32.0", "0.34.0")
PALLAS = "vllm/v1/attention/backends/pallas.py"
TRITON_WRITE = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
KV_CACHE_METHOD = "vllm/model_executor/layers/quantization/kv_cache.py"


class Package:
    """One downloaded wheel or source archive: its files by their path inside the package."""

    def __init__(self, path: Path) -> None:
        self.path, self.sha256 = path, hashlib.sha256(path.read_bytes()).hexdigest()
        self._files: dict[str, bytes] = {}
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as archive:
                self._files = {name: archive.read(name) for name in archive.namelist()
                               if name.endswith((".py", "METADATA"))}
        else:  # an sdist: drop the top folder (name-version/)
            with tarfile.open(path) as archive:
                for member in archive.getmembers():
                    if member.isfile() and member.name.endswith((".py", "PKG-INFO")):
                        handle = archive.extractfile(member)
                        if handle is not None:
                            self._files[member.name.split("/", 1)[1]] = handle.read()

    def text(self, name: str) -> str | None:
        data = self._files.get(name)
        return None if data is None else data.decode("utf-8")

    def requires(self) -> list[str]:
        meta = next((self.text(n) for n in self._files if n.endswith(("METADATA", "PKG-INFO")) and n.count("/") <= 1), "")
        return sorted({line.split(":", 1)[1].strip() for line in (meta or "").splitlines()
                       if line.startswith("Requires-Dist:")})


def download(name: str, version: str, into: Path) -> Package:
    folder = into / f"{name}-{version}"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"{name}=={version}", "-d",
                    str(folder)], check=True, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    return Package(next(folder.iterdir()))


def lines_matching(text: str | None, pattern: str) -> list[str]:
    """The stripped lines of `text` matching `pattern`, with their line numbers."""
    if text is None:
        return []
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if re.search(pattern, line)]


def tpu_release(package: Package) -> dict:
    requires = package.requires()
    platform = package.text("vllm/platforms/tpu.py")
    write = package.text(PALLAS)
    return {
        "sha256": package.sha256,
        "torch": [r for r in requires if re.match(r"torch(_xla)?\b", r)],
        "requires_tpu_inference": [r for r in requires if r.startswith("tpu-inference")],
        "platform_lines": lines_matching(platform, r"tpu_inference|tpu_commons|USE_TPU_INFERENCE"),
        "has_torch_xla_backend": write is not None,
        "write_lines": lines_matching(write, r"key = key\.to\(torch\.float32\) / k_scale|torch\.clamp\(key|"
                                             r"_k_scale_float == 1\.0"),
        # the torch_xla backend runs by default only where nothing installs tpu-inference beside it
        "default_backend": ("tpu-inference" if any(r.startswith("tpu-inference") for r in requires)
                            else "vllm torch_xla" if write is not None else "none"),
    }


def cuda_release(package: Package) -> dict:
    requires = package.requires()
    return {
        "sha256": package.sha256,
        "torch": [r for r in requires if re.match(r"torch\b", r)],
        "triton_write_lines": lines_matching(package.text(TRITON_WRITE), r"/ tl\.load\(k_scale\)"),
        "per_tensor_only_lines": lines_matching(package.text(KV_CACHE_METHOD),
                                                r"Only support per-tensor scaling factor for fp8 KV cache"),
        "unit_scale_warning_lines": lines_matching(package.text(KV_CACHE_METHOD), r"Using KV cache scaling factor 1\.0"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = {
            "probe": "probes/probe_vllm_packages.py",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "evidence": "packaged: read from each release's files as published, not run",
            "vllm-tpu": {v: tpu_release(download("vllm-tpu", v, Path(tmp))) for v in TPU_RELEASES},
            "vllm": {v: cuda_release(download("vllm", v, Path(tmp))) for v in CUDA_RELEASES},
        }
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    partial = args.out.with_suffix(".json.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(args.out)
    out = io.StringIO()
    for version, row in record["vllm-tpu"].items():
        out.write(f"vllm-tpu {version:>9}: default TPU backend {row['default_backend']}\n")
    for version, row in record["vllm"].items():
        out.write(f"vllm {version:>13}: {', '.join(row['torch'])}; Triton write divides: {bool(row['triton_write_lines'])}\n")
    print(out.getvalue() + f"wrote {args.out}")


if __name__ == "__main__":
    main()
