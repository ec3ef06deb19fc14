"""Run every CPU benchmark with its default settings; each prints a table and writes bench/results/*.json.

The 8B-shaped layer-by-layer run (about 16 GB on disk) is not part of this; run it on its own:
    .venv/bin/python bench/bench_layerwise.py big
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent
RUNS = (
    ["bench_calibrate.py"],
    ["bench_verify.py"],
    ["bench_runtime.py"],
    ["bench_layerwise.py", "depth"],
    ["bench_headroom.py"],
)


def main() -> int:
    failed = []
    for script, *args in RUNS:
        print(f"\n== {script} {' '.join(args)}", flush=True)
        if subprocess.call([sys.executable, str(BENCH / script), *args]) != 0:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
