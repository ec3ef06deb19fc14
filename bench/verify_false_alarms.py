"""How often verify raises a false alarm on good checkpoints, and how often it catches damaged ones.

Good: `fp8kv calibrate` with the default margin on `--calib-seeds` draws of the bundled calibration text, each
verified on `--heldout-seeds` draws of each `--texts` (every released engine): the bundled held-out split, and
`generated`, the model's own answers through its chat template, whose samples share the template's first tokens.
Damaged, from the first good calibration of each model, written as another tool would write them (the same folder
without fp8kv.json, its scale tensors rewritten): every scale x0.25 (clipping), every scale x16 (values pushed
toward e4m3's subnormals), one layer's K and V scales swapped; and through fp8kv's own writer, llm-compressor's
default observer (the last batch's amax, batch 1, no margin). Each damaged folder is verified on the same held-out draws.

Prints, per model and case, how many runs PASS / WARN / FAIL and how many WARNed that calibrated scales do worse
than unit scales (the comparison `false_alarm_rate` holds), and writes bench/results/verify_false_alarms.json.

    .venv/bin/python bench/verify_false_alarms.py [--models bundled,bundled-outliers] [--calib-seeds 3]
        [--heldout-seeds 4] [--samples 16] [--seq-len 128] [--texts bundled,generated]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, VERIFY_DIR
from fp8kv.checkpoint.conventions import SCALES_FILE
from fp8kv.data import GENERATED_DATASET, DataRequest
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import verify
from fp8kv.verify.verdict import load_thresholds

import common  # bench/common.py

UNIT_WARNING = "calibrated scales do worse than unit scales"
TEXTS = ("bundled", GENERATED_DATASET)  # --texts: the held-out texts every checkpoint can be verified on
Damage = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def times(factor: float) -> Damage:
    return lambda tensors: {name: t * factor if name.endswith("_scale") else t for name, t in tensors.items()}


def swap_first_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """K's scale where V's was and V's where K's was, in the first layer that has both."""
    k = sorted(name for name in tensors if name.endswith("self_attn.k_scale"))[0]
    v = k.replace("k_scale", "v_scale")
    return {**tensors, k: tensors[v], v: tensors[k]}


DAMAGES: dict[str, Damage] = {"x0.25": times(0.25), "x16": times(16.0), "K/V swapped": swap_first_layer}


def damaged_copy(calibrated: Path, out: Path, damage: Damage) -> Path:
    """`calibrated` without fp8kv.json (so verify judges it as a foreign checkpoint) and its scales damaged."""
    shutil.copytree(calibrated, out, ignore=shutil.ignore_patterns(PROVENANCE_FILE, VERIFY_DIR))
    scales = out / SCALES_FILE
    save_file(damage(load_file(scales)), scales)
    return out


def outcome(model_dir: Path, report: Path, text: str, heldout_seed: int, args: argparse.Namespace) -> dict:
    data = DataRequest(text, num_samples=args.samples, seq_len=args.seq_len, seed=heldout_seed)
    clock = time.perf_counter()
    result = verify(VerifyRequest(model_dir, data=data, report_dir=report, device="cpu"))
    reasons = [r for r in result.report.reasons if r.level in ("WARN", "FAIL")]
    return {"verdict": result.verdict, "unit_warning": any(UNIT_WARNING in r.message for r in reasons),
            "reasons": [f"{r.level}: {r.message}" for r in reasons], "seconds": time.perf_counter() - clock}


def run_model(model: str, root: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    good = []
    for calib_seed in range(args.calib_seeds):
        out = root / f"{model}-good-{calib_seed}"
        data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples, seq_len=args.seq_len,
                           seed=calib_seed)
        calibrate(CalibrationRequest(model=model, out=out, data=data))
        good.append(("good", f"calibration seed {calib_seed}", out))
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples, seq_len=args.seq_len, seed=0)
    observer = root / f"{model}-last-batch"
    calibrate(CalibrationRequest(model=model, out=observer, data=data, strategy="last-batch", headroom=1.0,
                                 batch_size=1, layerwise=False))
    damaged = [("damaged", name, damaged_copy(good[0][2], root / f"{model}-{i}", damage))
               for i, (name, damage) in enumerate(DAMAGES.items())]
    damaged.append(("damaged", "llm-compressor's observer", observer))
    for text in args.texts.split(","):
        for kind, case, folder in good + damaged:
            for heldout_seed in range(args.heldout_seeds):
                row = outcome(folder, root / "reports" / f"{folder.name}-{text}-{heldout_seed}", text, heldout_seed,
                              args)
                rows.append({"model": model, "text": text, "kind": kind, "case": case, "heldout_seed": heldout_seed,
                             **row})
                print(f"  {model} {case} {text} held-out seed {heldout_seed}: {row['verdict']} "
                      f"({row['seconds']:.0f} s)")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | held-out text | checkpoint | case | runs | PASS | WARN | FAIL | WARN: worse than unit scales |",
             "|---|---|---|---|---|---|---|---|---|"]
    cases = dict.fromkeys((r["model"], r["text"], r["kind"], r["case"]) for r in rows)
    for model, text, kind, case in cases:
        chosen = [r for r in rows if (r["model"], r["text"], r["kind"], r["case"]) == (model, text, kind, case)]
        count = {v: sum(r["verdict"] == v for r in chosen) for v in ("PASS", "WARN", "FAIL")}
        lines.append(f"| {model} | {text} | {kind} | {case} | {len(chosen)} | {count['PASS']} | {count['WARN']} | "
                     f"{count['FAIL']} | {sum(r['unit_warning'] for r in chosen)} |")
    good = [r for r in rows if r["kind"] == "good"]
    lines.append(f"\nGood checkpoints: {sum(r['verdict'] != 'PASS' for r in good)} of {len(good)} runs not PASS, "
                 f"{sum(r['unit_warning'] for r in good)} WARNed worse than unit scales (stated rate: "
                 f"{load_thresholds().false_alarm_rate:.0%} per run). Damaged: "
                 f"{sum(r['verdict'] == 'PASS' for r in rows if r['kind'] == 'damaged')} PASS.")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--models", default="bundled,bundled-outliers")
    options.add_argument("--calib-seeds", type=int, default=3)
    options.add_argument("--heldout-seeds", type=int, default=4)
    options.add_argument("--samples", type=int, default=16)
    options.add_argument("--seq-len", type=int, default=128)
    options.add_argument("--texts", default="bundled", help=f"held-out texts, comma-separated: {', '.join(TEXTS)}")
    args = options.parse_args()
    unknown = set(args.texts.split(",")) - set(TEXTS)
    if unknown:
        options.error(f"--texts: {', '.join(sorted(unknown))} is not one of {', '.join(TEXTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8kv-false-alarms-") as root:
        for model in args.models.split(","):
            rows += run_model(model, Path(root), args)
    print(table(rows))
    common.write_results("verify_false_alarms", rows, args)


if __name__ == "__main__":
    main()
