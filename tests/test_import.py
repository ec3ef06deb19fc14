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


def test_the_command_line_backs_large_tensors_with_huge_pages_unless_told_otherwise():
    probe = ("import os, sys\n{before}\nfrom fp8kv import cli\ncli._huge_pages_for_large_tensors()\n"
             "import torch\nprint(os.environ.get(cli.HUGE_PAGES_ENV))")

    def switch(before: str = "", **preset: str) -> str:
        env = {**{k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}, **preset}
        proc = subprocess.run([sys.executable, "-c", probe.format(before=before)], capture_output=True, text=True,
                              env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert switch() == "1"
    assert switch(THP_MEM_ALLOC_ENABLE="0") == "0"  # the user's choice stands
    assert switch("import torch") == "None"  # torch read the switch already: nothing claims otherwise
