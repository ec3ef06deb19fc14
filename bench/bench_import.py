"""What `import fp8kv.api` costs a process that already imports torch and transformers, as whole processes.

Runs, in turn and REPEATS times each (after one warm-up round), `python -c` with `import torch, transformers`
(the yardstick), `import fp8kv.api`, and `import torch, transformers, fp8kv.api` (an RL trainer's or a notebook's
process), with PJRT_DEVICE and USE_TORCH_XLA unset as a user's shell has them. Prints the median wall and CPU time
of each and the medians of the paired differences from the yardstick (the goal: at most 1 s more). Writes
bench/results/import_torch-VERSION.json, so each venv keeps its own.

    .venv/bin/python bench/bench_import.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import common  # bench/common.py

YARDSTICK = "import torch, transformers"
IMPORTS = (YARDSTICK, "import fp8kv.api", "import torch, transformers, fp8kv.api")


def timed(code: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of `python -c code`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"python -c {code!r} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--repeats", type=int, default=5)
    args = options.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    for code in IMPORTS:  # warm-up: the page cache holds every module's files before the first counted run
        timed(code, env)
    runs: dict[str, list[tuple[float, float]]] = {code: [] for code in IMPORTS}
    for _ in range(args.repeats):  # in turn, so a drift in the machine's speed reaches each import alike
        for code in IMPORTS:
            runs[code].append(timed(code, env))
    rows = []
    for code in IMPORTS:
        pairs = list(zip(runs[code], runs[YARDSTICK]))
        rows.append({"import": code, "wall_s": statistics.median(w for w, _ in runs[code]),
                     "cpu_s": statistics.median(c for _, c in runs[code]),
                     "wall_over_yardstick_s": statistics.median(a[0] - b[0] for a, b in pairs),
                     "cpu_over_yardstick_s": statistics.median(a[1] - b[1] for a, b in pairs)})
    load = os.getloadavg()
    print(f"python -c IMPORT as a whole process; median of {args.repeats}; load average {load[0]:.1f} on "
          f"{os.cpu_count()} CPUs; {sys.prefix}")
    print(f"| import | wall s | CPU s | over `{YARDSTICK}`: wall s | CPU s |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| `{row['import']}` | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {row['wall_over_yardstick_s']:+.2f} "
              f"| {row['cpu_over_yardstick_s']:+.2f} |")
    import torch

    common.write_results(f"import_torch-{torch.__version__}", rows, args, load_average=load, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
