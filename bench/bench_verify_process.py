"""`fp8kv verify` on the bundled model as a user runs it: a whole process, imports included.

Calibrates the bundled model once into a temporary folder, then runs `python -m fp8kv verify DIR` REPEATS
times per setting and prints, per setting, the median wall time, the process's CPU time, the import time
of the verify command (`python -c "import fp8kv.verify.run"`), and verify's own stage timings from
report.json. Settings: as shipped, and with transformers/accelerate allowed to import torch_xla
(`USE_TORCH_XLA=1`, what fp8kv avoided before). Writes bench/results/verify_process.json.

    .venv/bin/python bench/bench_verify_process.py [--repeats 3] [--num-samples 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # bench/common.py

SETTINGS = {"as shipped": {}, "torch_xla imported by transformers": {"USE_TORCH_XLA": "1"}}


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one command, which must succeed with PASS or WARN."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--num-samples", type=int, default=16)
    args = options.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("USE_TORCH_XLA", "PJRT_DEVICE")}
    fp8kv = [sys.executable, "-m", "fp8kv"]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "bundled-fp8kv"
        timed([*fp8kv, "calibrate", "bundled", "--dataset", "bundled", "--out", str(out), "-q"], base)
        for name, extra in SETTINGS.items():
            env = {**base, **extra}
            # What `fp8kv verify --device cpu` imports: the CLI sets USE_TORCH_XLA=0 unless the setting says otherwise.
            import_env = {**env, "USE_TORCH_XLA": env.get("USE_TORCH_XLA", "0")}
            imports = [timed([sys.executable, "-c", "import fp8kv.verify.run"], import_env)[0]
                       for _ in range(args.repeats)]
            runs, stages = [], []
            for _ in range(args.repeats):
                runs.append(timed([*fp8kv, "verify", str(out), "--device", "cpu", "--num-samples",
                                   str(args.num_samples), "-q"], env))
                stages.append(json.loads((out / "verify" / "report.json").read_text())["timings_s"])
            rows.append({"setting": name, "wall_s": statistics.median(w for w, _ in runs),
                         "cpu_s": statistics.median(c for _, c in runs), "import_s": statistics.median(imports),
                         "stages_s": {k: statistics.median(s[k] for s in stages) for k in stages[0]}})
    load = os.getloadavg()
    print(f"verify, bundled model, {args.num_samples} held-out samples, --device cpu; median of {args.repeats}; "
          f"load average {load[0]:.1f} on {os.cpu_count()} CPUs")
    print("| setting | wall s | CPU s | import s | verify's stages (s) |\n|---|---|---|---|---|")
    for row in rows:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in row["stages_s"].items())
        print(f"| {row['setting']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['import_s']:.1f} | {stages} |")
    common.write_results("verify_process", rows, args, load_average=load, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
