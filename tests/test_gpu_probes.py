"""The lent-GPU scripts on a machine whose torch sees no GPU: one line, exit 4, nothing written; and the NVFP4
script's dry run, which checks its prerequisites without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, name", [("probes/gpu_writes.sh", "writes"), ("probes/gpu_conformance.sh", "conformance"),
                                          ("probes/gpu_nvfp4.sh", "nvfp4"), ("bench/gpu_8b.sh", "gpu")])
def test_a_gpu_script_without_a_gpu_is_one_line_and_exit_4(tmp_path, script, name):
    # an empty CUDA_VISIBLE_DEVICES hides every GPU from torch, so this holds on a machine with one too
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stdout.splitlines() == [f"{name}: needs a CUDA GPU, and torch in {sys.executable} sees none here; "
                                        "nothing run"]
    assert not list(tmp_path.iterdir())


def test_the_nvfp4_dry_run_names_the_missing_flashinfer_headers(tmp_path):
    """gpu_nvfp4.sh --dry-run checks what the GPU run needs before a GPU is lent: without FlashInfer's headers it
    says which and how to get them, in one line, exit 4."""
    include = tmp_path / "include"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "FLASHINFER_INCLUDE": str(include)}
    done = subprocess.run(["bash", str(REPO / "probes/gpu_nvfp4.sh"), "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stdout.splitlines() == [f"nvfp4: no {include}/flashinfer/page.cuh or CCCL beside it; run bash "
                                        "probes/gpu_nvfp4.sh --prepare here first"]
