"""How fast the commands that need no model answer, and whether they import torch: --help, usage errors, card,
push --dry-run, inspect.

Calibrates the bundled model once into a temporary folder (card, push and inspect read it), then runs each
command line REPEATS times as the `fp8kv` console script runs it (`fp8kv.cli.main` in a fresh interpreter) and
prints its exit code, whether torch was imported by the end, and the median wall and CPU time of the process.
Writes bench/results/cli_startup.json.

    .venv/bin/python bench/bench_cli_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # bench/common.py

# The console script's entry point, then one line on stderr saying whether torch was imported.
PROBE = ("import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\ntry:\n    main()\n"
         "except SystemExit as exc:\n    code = exc.code or 0\nelse:\n    code = 0\n"
         "print('probe', code, 'torch' in sys.modules, file=sys.stderr)\n")
COMMANDS = (
    ["--help"], ["calibrate", "--help"], ["verify", "--help"], ["eval", "--help"], ["card", "--help"],
    ["push", "--help"], ["conformance", "--help"],
    ["calibrate", "bundled", "--strategy", "minmax"], ["verify", "bundled", "--engine", "fast"],
    ["eval", "bundled", "--limit", "-3"], ["conformance", "simulate", "PACK", "--out", "x", "--bug", "raw"],
    ["card", "{out}"], ["push", "{out}", "--repo-id", "me/x", "--dry-run", "--force"], ["inspect", "{out}"],
)


def run(args: list[str]) -> tuple[int, bool, float, float]:
    """(exit code, torch imported, wall seconds, CPU seconds) of one command line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, code, torch = proc.stderr.strip().splitlines()[-1].split()
    return int(code), torch == "True", wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--repeats", type=int, default=3)
    args = options.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "bundled-fp8kv"
        subprocess.run([sys.executable, "-m", "fp8kv", "calibrate", "bundled", "--dataset", "bundled", "--num-samples",
                        "4", "--seq-len", "32", "--out", str(out), "-q"], check=True, capture_output=True)
        for command in COMMANDS:
            line = [part.format(out=out) for part in command]
            runs = [run(line) for _ in range(args.repeats)]
            rows.append({"command": " ".join(command).replace("{out}", "DIR"), "exit": runs[0][0],
                         "torch": any(r[1] for r in runs), "wall_s": statistics.median(r[2] for r in runs),
                         "cpu_s": statistics.median(r[3] for r in runs)})
    load = os.getloadavg()
    print(f"fp8kv command lines that load no model; median of {args.repeats}; load average {load[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print("| command | exit | torch imported | wall s | CPU s |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| `fp8kv {row['command']}` | {row['exit']} | {'yes' if row['torch'] else 'no'} | {row['wall_s']:.2f} "
              f"| {row['cpu_s']:.2f} |")
    common.write_results("cli_startup", rows, args, load_average=load, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
