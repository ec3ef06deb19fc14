"""NVIDIA's and PyTorch's conversion headers from the venv, and a host build of a test's C++ file against them."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import torch


def include_dirs() -> list[Path]:
    """cuda_fp8.h / cuda_fp4.h and what they include (cuda_runtime, crt from cuda_nvcc, nv/target from
    cuda_cccl), and c10."""
    dirs = []
    for package in ("nvidia.cuda_runtime", "nvidia.cuda_nvcc", "nvidia.cuda_cccl"):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, \
            f"{package} is not installed: `make test` installs it with the dev extra"
        dirs.append(Path(next(iter(spec.submodule_search_locations))) / "include")
    return [*dirs, Path(torch.__file__).parent / "include"]


def build(source: Path, binary: Path) -> Path:
    """`source` compiled for the host into `binary`; floating-point expressions are rounded as written (no fused
    multiply-adds), so the C++ states each rounding the way the Python models do."""
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, f"a C++ compiler (g++) is needed to build {source.name}"
    includes = [f"-I{d}" for d in include_dirs()]
    subprocess.run([compiler, "-std=c++17", "-O2", "-ffp-contract=off", *includes, str(source), "-o", str(binary)],
                   check=True)
    return binary
