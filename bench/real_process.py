"""`fp8kv calibrate` and `fp8kv verify` on a real model as whole processes, against a plain transformers forward
over the same tokens, also a whole process (imports, model load, tokenization included).

The plain process loads the causal LM with `AutoModelForCausalLM.from_pretrained`, reads the same samples
with fp8kv's data stage (the same records, shuffle and truncation) and runs `model(input_ids,
attention_mask)` over the same right-padded batches. calibrate's goal is 0.9x its plain forward, verify's
2.5x its own (verify reads its held-out samples: one forward over them is its plain reference). Each
command runs `--repeats` times, interleaved; medians of wall time and of CPU time (user + system, from
the child's resource usage) are reported with the load average (`uptime`) before and after. On a
machine others load, the CPU-time ratio is the steadier one; `--threads 1` makes it steadier still.
The plain process also times its forward alone: each further forward at that speed (verify runs one prefill
per distinct cache) adds that share of the plain process, a floor no saving elsewhere removes.
With `--kv-dtype nvfp4` (or nvfp4_4over6, fp8_k_nvfp4_v) calibrate writes that cache's scales and verify judges
them per engine path: each distinct NVFP4 cache it runs (write, read, global scales) is one more prefill of the
held-out text, and verify's report times each (`timings_s`, "prefill ..."); those are printed in units of the plain
process's forward alone, one prefill of the same tokens.
Writes bench/results/real_process.json (another `--model`: real_process-NAME.json; `--engine E`: -E added;
`--kv-dtype D`: -D added).

    .venv/bin/python bench/real_process.py [--model smollm2 | gemma3-shape] [--samples 32] [--seq-len 256] [--repeats 3] [--threads N]
        [--engine vllm-cuda] [--kv-dtype nvfp4]
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

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT
from fp8kv.options import DEFAULT_KV_DTYPE
from fp8kv.runtime.linear import cpu_kernels

import common  # bench/common.py

PLAIN = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from fp8kv.data import DataRequest, load_calibration_data, make_batches, pad_id
folder, text, samples, seq_len, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
data = load_calibration_data(DataRequest(text, num_samples=samples, seq_len=seq_len), tokenizer)
start = time.perf_counter()
with torch.no_grad():
    for b in make_batches(data.samples, batch, pad_id(tokenizer)):
        model(input_ids=b.input_ids, attention_mask=b.attention_mask)
print(f"forward_s={time.perf_counter() - start:.3f}")
"""
FORWARD_LINE = "forward_s="  # the plain process's last line: seconds of its forward alone
PREFILL = "prefill "  # how the keys of verify's timings_s of each runner's prefills of the held-out text start


GEMMA3_SHAPE = "gemma3-shape"  # --model: common.gemma3_shape, built in the temporary folder


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one command, which must exit 0 (verify: with any verdict, 0, 1 or 3), and its
    standard output."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1, 3):
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime), proc.stdout


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--model", default="smollm2", help=f"a model fp8kv resolves, or {GEMMA3_SHAPE}")
    options.add_argument("--samples", type=int, default=32, help="calibration samples")
    options.add_argument("--heldout-samples", type=int, default=16, help="verify's held-out samples")
    options.add_argument("--seq-len", type=int, default=256)
    options.add_argument("--batch-size", type=int, default=8)
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every process (default: unset)")
    options.add_argument("--device", default="cpu", help="recorded only: every process runs on the CPU")
    options.add_argument("--engine", default=None, help="verify's --engine (default: every released engine)")
    options.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, help="calibrate's --kv-dtype")
    args = options.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fp8kv-real-process-"))
    # a GGUF is converted once, and the Gemma shape built once, before anything is timed
    folder = common.gemma3_shape(work) if args.model == GEMMA3_SHAPE else resolve_model(args.model)
    python = [sys.executable]
    out = work / "calibrated"
    shape = ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--quiet"]
    commands = {
        "plain forward (calibration tokens)": [*python, "-c", PLAIN, str(folder), str(BUNDLED_CALIBRATION_TEXT),
                                               str(args.samples), str(args.seq_len), str(args.batch_size)],
        "fp8kv calibrate": [*python, "-m", "fp8kv", "calibrate", str(folder), "--dataset", str(BUNDLED_CALIBRATION_TEXT),
                            "--num-samples", str(args.samples), "--out", str(out), "--overwrite",
                            "--kv-dtype", args.kv_dtype, *shape],
        "plain forward (held-out tokens)": [*python, "-c", PLAIN, str(folder), str(BUNDLED_HELDOUT_TEXT),
                                            str(args.heldout_samples), str(args.seq_len), str(args.batch_size)],
        "fp8kv verify": [*python, "-m", "fp8kv", "verify", str(out), "--dataset", str(BUNDLED_HELDOUT_TEXT),
                         "--num-samples", str(args.heldout_samples), *shape,
                         *(["--engine", args.engine] if args.engine else [])],
    }
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    before = load()
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    forward: dict[str, list[float]] = {name: [] for name in commands if name.startswith("plain")}
    prefills: dict[str, list[float]] = {}  # verify's seconds per runner's prefill of the held-out text
    for _ in range(args.repeats):
        for name, command in commands.items():
            seconds, cpu_seconds, stdout = timed(command, env)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
            if name in forward:
                forward[name].append(float(stdout.strip().splitlines()[-1].removeprefix(FORWARD_LINE)))
            if name == "fp8kv verify":
                timings = json.loads((out / "verify" / "report.json").read_text())["timings_s"]
                for phase, seconds in timings.items():
                    if phase.startswith(PREFILL):
                        prefills.setdefault(phase.removeprefix(PREFILL), []).append(seconds)
            print(f"  {name}: {seconds:.1f} s wall, {cpu_seconds:.1f} s CPU", file=sys.stderr)
    after = load()
    reference = {"fp8kv calibrate": "plain forward (calibration tokens)", "fp8kv verify": "plain forward (held-out tokens)"}
    goals = {"fp8kv calibrate": 0.9, "fp8kv verify": 2.5}

    def ratios(times: dict[str, list[float]]) -> dict[str, float]:
        median = {name: statistics.median(values) for name, values in times.items()}
        return {name: median[name] / median[plain] for name, plain in reference.items()}

    wall_ratio, cpu_ratio = ratios(wall), ratios(cpu)
    label = f"{args.model} --engine {args.engine}" if args.engine else args.model
    print(f"\n{label}: {args.samples} calibration / {args.heldout_samples} held-out samples x {args.seq_len} tokens, "
          f"batch {args.batch_size}, threads {args.threads or 'default'}, median of {args.repeats}\n"
          f"load before: {before}\nload after:  {after}\ntorch's CPU kernels: {cpu_kernels()}\n")
    print("| process | wall s (median) | CPU s (median) | x plain, wall | x plain, CPU | goal |\n|---|---|---|---|---|---|")
    for name in commands:
        shown = [f"{wall_ratio[name]:.2f}", f"{cpu_ratio[name]:.2f}"] if name in goals else ["-", "-"]
        goal = f"<= {goals[name]:g}" if name in goals else "-"
        print(f"| {name} | {statistics.median(wall[name]):.1f} | {statistics.median(cpu[name]):.1f} | {shown[0]} | "
              f"{shown[1]} | {goal} |")
    # verify runs one prefill of the held-out tokens per distinct cache: each one past the first costs at least
    # what the plain process's forward costs, whatever else verify spares
    plain = reference["fp8kv verify"]
    alone = statistics.median(forward[plain])
    print(f"\n{plain}: its forward alone {alone:.1f} s of {statistics.median(wall[plain]):.1f} s; each further "
          f"forward at that speed adds {alone / statistics.median(wall[plain]):.2f}x")
    if prefills:
        print(f"\nverify's prefills of the held-out text, each in units of the plain forward alone ({alone:.1f} s):\n"
              "| runner | s (median) | x one prefill |\n|---|---|---|")
        for runner, seconds in prefills.items():
            print(f"| {runner} | {statistics.median(seconds):.1f} | {statistics.median(seconds) / alone:.2f} |")
    rows = [{"process": name, "wall_s": wall[name], "cpu_s": cpu[name], "wall_ratio": wall_ratio.get(name),
             "cpu_ratio": cpu_ratio.get(name), "goal": goals.get(name), "forward_s": forward.get(name)}
            for name in commands]
    rows += [{"verify_prefill": runner, "seconds": seconds, "per_prefill": statistics.median(seconds) / alone}
             for runner, seconds in prefills.items()]
    results = "real_process" if args.model == options.get_default("model") else f"real_process-{Path(args.model).name}"
    if args.engine:
        results += f"-{args.engine.replace(',', '+').replace('/', '-')}"
    if args.kv_dtype != DEFAULT_KV_DTYPE:
        results += f"-{args.kv_dtype}"
    common.write_results(results, rows, args, load_before=before, load_after=after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
