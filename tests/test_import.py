"""`import fp8kv.api` is quiet and light: an RL trainer or a notebook imports it into a process it shares."""

from __future__ import annotations

import os
import subprocess
import sys

# The TPU stack and the evaluation harness: seconds to import, and torch_xla logs a warning when PJRT_DEVICE is unset.
HEAVY = ("torch_xla", "jax", "lm_eval")


def test_importing_the_api_loads_no_tpu_or_eval_stack_and_prints_nothing():
    probe = f"import sys\nimport fp8kv.api\nsys.exit(', '.join(m for m in {HEAVY!r} if m in sys.modules) or None)"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
