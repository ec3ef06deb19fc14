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

Table 2: scales calibrated on the documentation against `--dataset generated` (the model's own answers
through its chat template): the per-layer scale ratio, and both scales scored on both held-out texts.
Prints both tables and writes bench/results/real_model.json.

    .venv/bin/python bench/real_model.py [--model smollm2] [--calib-samples 32] [--heldout-samples 16]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.load import load_language_model
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.engine_models import DEFAULT_ENGINE, RELEASED, engine_model
from fp8kv.data import GENERATED_DATASET, CalibrationData, DataRequest, load_calibration_data
from fp8kv.evaluation.bundled_tasks import arithmetic_items
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT
from fp8kv.observe import KVStatistics
from fp8kv.options import DEFAULT_HEADROOM

import common  # bench/common.py
import kvcompare  # bench/kvcompare.py

BUGS = ("inverted-scale", "no-clamp", "scales-ignored")  # the conformance check's engine bugs
UNCLAMPED = "sglang@0.5.17"  # the last released cast without a clamp


def task_accuracy(model: kvcompare.Model, items: list[dict], scales: KVScales | None, engine: str) -> float:
    """Share of items whose right choice has the highest summed log-likelihood after the question."""
    encode = lambda text: model.tokenizer(text)["input_ids"]  # noqa: E731
    sequences, spans = [], []
    for item in items:
        context = encode(item["question"])
        for choice in item["choices"]:
            ids = encode(item["question"] + choice)
            sequences.append(ids)
            spans.append(len(context))
    logits = model.run(sequences, scales, engine).logits
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
                             "task_accuracy": task_accuracy(model, items, scales, engine)}
        rows.append({"table": "seed", "cache": cache, "scales": label, "engine": engine, **measured[key]})
        print(f"  {label} / {engine}: done", file=sys.stderr)
    return rows


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
    seed = [r for r in rows if r["table"] == "seed"]
    lines = ["| cache | scales | engine | held-out PPL | KL vs bf16 | top-1 | sequences lost | task accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['scales']} | {r['engine']} | {r['ppl']:.3f} | {r['kl_mean']:.5f} | {r['top1']:.4f} "
              f"| {r['sequences_lost']} of {r['sequences']} | {r['task_accuracy']:.3f} |" for r in seed]
    ratio = next((r for r in rows if r["table"] == "ratio"), None)
    if ratio is None:  # --seed-table-only
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
    rows = seed_table(model, texts["documentation"], held["documentation"], items)
    if not args.seed_table_only:
        writer = load_language_model(path, "cpu")  # plain attention: it writes the generated text
        texts["generated"] = load_calibration_data(ask(GENERATED_DATASET, args.calib_samples), model.tokenizer,
                                                   model=writer)
        held["generated"] = load_calibration_data(ask(GENERATED_DATASET, args.heldout_samples), model.tokenizer,
                                                  model=writer, held_out=True).samples
        rows += text_table(model, texts, held)
    print(f"\n{args.model}: calibrated on {args.calib_samples} x {args.seq_len} tokens, {args.heldout_samples} held-out "
          f"records, {len(items)} fp8kv_arith_mc items ({time.perf_counter() - clock:.0f} s)\n")
    print(markdown(rows))
    common.write_results("real_model", rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
