"""The lent-GPU scripts on a machine whose torch sees no GPU: one line, exit 4, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, name", [("probes/gpu_writes.sh", "writes"), ("probes/gpu_conformance.sh", "conformance"),
                                          ("bench/gpu_8b.sh", "gpu")])
def test_a_gpu_script_without_a_gpu_is_one_line_and_exit_4(tmp_path, script, name):
    # an empty CUDA_VISIBLE_DEVICES hides every GPU from torch, so this holds on a machine with one too
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stdout.splitlines() == [f"{name}: needs a CUDA GPU, and torch in {sys.executable} sees none here; "
                                        "nothing run"]
    assert not list(tmp_path.iterdir())
