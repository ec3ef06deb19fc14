"""What calibration buys: bf16, unit scales, calibrated scales with and without a margin, llm-compressor's observer.

Each bundled model is calibrated on its own calibration split (64 x 512 tokens, as `fp8kv calibrate MODEL
--num-samples 64 --seq-len 512` would) and
scored on 40 of the 78 held-out records on fp8kv's paged runtime, per row of

    | cache | scales | engine | held-out PPL | KL vs bf16 | top-1 | sequences lost |

`vllm-tpu` clamps to ±448 before the fp8 cast; `no-clamp` (the seed's draft) and `sglang` cast without
a clamp (NaN above 464); fp8kv.engine_models states each. llm-compressor's default kv-cache observer
(memoryless_minmax) is mimicked by `--strategy last-batch --batch-size 1 --headroom 1.0`: its
scale is recomputed at every forward and the last sample's wins. A sequence is lost when any of its
logits is NaN/inf. Prints one table per model and a sentence; writes bench/results/demo.json.
Exits 1 when the default margin loses a sequence or stores a NaN on either engine.

    .venv/bin/python bench/demo_table.py [--models bundled-outliers bundled] [--heldout-samples 40]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from fp8kv.data import DataRequest
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.options import DEFAULT_HEADROOM
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT

import common  # bench/common.py
import kvcompare  # bench/kvcompare.py

CALIBRATION = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=64, seq_len=512)  # what `make demo` uses


@dataclass(frozen=True)
class Row:
    """One line of the table: which cache, scales and engine, and how it scored against bf16."""

    cache: str
    scales: str
    engine: str
    scores: kvcompare.Scores
    nan_stored: int


def calibrated(model: str, **settings) -> KVScales:
    """The scales `fp8kv calibrate MODEL` writes with these settings (nothing written to disk)."""
    return calibrate(CalibrationRequest(model=model, data=CALIBRATION, **settings)).scales


def rows_for(model_name: str, heldout_samples: int) -> list[Row]:
    model = kvcompare.Model.open(resolve_model(model_name))
    samples = model.data(BUNDLED_HELDOUT_TEXT, heldout_samples, CALIBRATION.seq_len).samples
    reference = model.run(samples, None)
    unit = KVScales.from_floats(dict.fromkeys(model.kv_layers, 1.0), dict.fromkeys(model.kv_layers, 1.0))
    default = calibrated(model_name)
    tight = calibrated(model_name, headroom=1.0)
    mimic = calibrated(model_name, strategy="last-batch", batch_size=1, headroom=1.0)
    plan = [
        ("unit (1.0)", unit, "vllm-tpu"),
        (f"calibrated, default margin {DEFAULT_HEADROOM:g}", default, "vllm-tpu"),
        (f"calibrated, default margin {DEFAULT_HEADROOM:g}", default, "no-clamp"),
        (f"calibrated, default margin {DEFAULT_HEADROOM:g}", default, "sglang"),
        ("calibrated, headroom 1.0", tight, "no-clamp"),
        ("llm-compressor's default observer (last-batch)", mimic, "no-clamp"),
    ]
    rows = [Row("bf16", "-", "-", kvcompare.compare(samples, reference, reference), 0)]
    for label, scales, engine in plan:
        run = model.run(samples, scales, engine)
        rows.append(Row("fp8", label, engine, kvcompare.compare(samples, run, reference), run.nonfinite_stored))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| cache | scales | engine | held-out PPL | KL vs bf16 | top-1 | sequences lost |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.scores
        lost = f"{s.sequences_lost} of {len(s.kl_per_sample)}"
        lines.append(f"| {r.cache} | {r.scales} | {r.engine} | {s.ppl:.3f} | {s.kl_mean:.5f} | {s.top1:.4f} | {lost} |")
    return "\n".join(lines)


def sentence(name: str, rows: list[Row]) -> str:
    bf16, unit, default_clamp, default_raw, default_raw_bf16, tight, mimic = rows
    n = len(bf16.scores.kl_per_sample)
    return (
        f"On {name}, unit scales give KL {unit.scores.kl_mean:.4f} against {default_clamp.scores.kl_mean:.4f} "
        f"calibrated; scales without a margin lose {tight.scores.sequences_lost} (headroom 1.0) and "
        f"{mimic.scores.sequences_lost} (llm-compressor's observer) of {n} held-out sequences to NaN on an engine "
        f"that does not clamp, while the default margin {DEFAULT_HEADROOM:g} loses "
        f"{default_raw.scores.sequences_lost + default_raw_bf16.scores.sequences_lost} on every engine at the "
        f"same KL."
    )


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--models", nargs="+", default=["bundled-outliers", "bundled"])
    options.add_argument("--heldout-samples", type=int, default=40, help="held-out records (of 78 in the split)")
    options.add_argument("--device", default="cpu", help="recorded only: the demo runs on the CPU")
    args = options.parse_args()
    results, unsafe = [], []
    for name in args.models:
        rows = rows_for(name, args.heldout_samples)
        print(f"\n{name}: calibrated on {CALIBRATION.num_samples} x {CALIBRATION.seq_len} tokens of its calibration "
              f"split, scored on {len(rows[0].scores.kl_per_sample)} held-out records of up to {CALIBRATION.seq_len} tokens\n")
        print(table(rows))
        print("\n" + sentence(name, rows))
        for row in rows[2:4]:
            if row.scores.sequences_lost or row.nan_stored:
                unsafe.append(f"{name}: default margin, {row.engine}: {row.nan_stored} NaN stored")
        results += [{"model": name, "cache": r.cache, "scales": r.scales, "engine": r.engine, "ppl": r.scores.ppl,
                     "kl_mean": r.scores.kl_mean, "top1": r.scores.top1, "sequences_lost": r.scores.sequences_lost,
                     "sequences": len(r.scores.kl_per_sample), "nan_stored": r.nan_stored} for r in rows]
    common.write_results("demo", results, args)
    for line in unsafe:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
