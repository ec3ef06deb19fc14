"""How often verify raises a false alarm on good checkpoints, and how often it catches damaged ones.

Good: `fp8kv calibrate` with the default margin on `--calib-seeds` draws of the bundled calibration text, each
verified on `--heldout-seeds` draws of each `--texts` (every released engine): the bundled held-out split, and
`generated`, the model's own answers through its chat template, whose samples share the template's first tokens.
Damaged, from the first good calibration of each model, written as another tool would write them (the same folder
without fp8kv.json, its scale tensors rewritten): every scale x0.25 (clipping), every scale x16 (values pushed
toward e4m3's subnormals), one layer's K and V scales swapped; and through fp8kv's own writer, llm-compressor's
default observer (the last batch's amax, batch 1, no margin). Each damaged folder is verified on the same held-out draws.

With `--kv-dtype nvfp4`, good is `fp8kv calibrate --kv-dtype nvfp4` (amax x headroom / 448, ModelOpt's current
convention) and verify judges each NVFP4 engine path apart. The damaged folders are ModelOpt's export as another
tool writes it (fp8kv.json dropped, the producer ModelOpt 0.42.0, whose files verify reads as amax / 448), its
global scales rewritten: every scale /6 (amax / 2688, ModelOpt's export before 0.42 and auto-round's, mislabelled),
x6, x0.25, and one layer's K and V swapped. A path whose loader multiplies by 6 WARNs on every good folder by
design: the finding names the 6x mismatch (its "runs the stored" line), counted apart from the other findings.

Prints, per model and case (and NVFP4 engine path), how many runs PASS / WARN / FAIL and how many WARNed that
calibrated scales do worse than unit scales (the comparison `false_alarm_rate` holds), and writes
bench/results/verify_false_alarms.json (verify_false_alarms_nvfp4.json for NVFP4).

    .venv/bin/python bench/verify_false_alarms.py [--models bundled,bundled-outliers] [--calib-seeds 3]
        [--heldout-seeds 4] [--samples 16] [--seq-len 128] [--texts bundled,generated] [--kv-dtype nvfp4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.calibrate.request import default_format
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, VERIFY_DIR
from fp8kv.checkpoint.conventions import HF_QUANT_CONFIG, SCALES_FILE
from fp8kv.checks import FAIL, WARN
from fp8kv.data import GENERATED_DATASET, DataRequest
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.options import DEFAULT_KV_DTYPE
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import VerifyResult, verify
from fp8kv.verify.verdict import load_thresholds

import common  # bench/common.py

UNIT_WARNING = "calibrated scales do worse than unit scales"
NVFP4 = "nvfp4"
# ModelOpt's export as of 0.42, whose NVFP4 global scales verify reads as amax / 448: the label a damaged NVFP4
# folder carries, as ModelOpt writes its producer block
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.42.0"}
TEXTS = ("bundled", GENERATED_DATASET)  # --texts: the held-out texts every checkpoint can be verified on
Damage = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def times(factor: float) -> Damage:
    return lambda tensors: {name: t * factor if name.endswith("_scale") else t for name, t in tensors.items()}


def swap_first_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """K's scale where V's was and V's where K's was, in the first layer that has both: `self_attn.k_scale` and
    `v_scale` (compressed-tensors), or `self_attn.k_proj.k_scale` and `v_proj.v_scale` (ModelOpt's NVFP4)."""
    k = sorted(name for name in tensors if name.endswith(("self_attn.k_scale", "self_attn.k_proj.k_scale")))[0]
    head, _, tail = k.rpartition("self_attn.")
    v = head + "self_attn." + tail.replace("k_", "v_")
    return {**tensors, k: tensors[v], v: tensors[k]}


DAMAGES: dict[str, dict[str, Damage]] = {  # per --kv-dtype
    DEFAULT_KV_DTYPE: {"x0.25": times(0.25), "x16": times(16.0), "K/V swapped": swap_first_layer},
    NVFP4: {"/6 (amax / 2688 labelled amax / 448)": times(1 / 6), "x6": times(6.0), "x0.25": times(0.25),
            "K/V swapped": swap_first_layer},
}


def damaged_copy(calibrated: Path, out: Path, damage: Damage) -> Path:
    """`calibrated` without fp8kv.json (so verify judges it as a foreign checkpoint) and its scales damaged; an NVFP4
    folder's producer made ModelOpt 0.42's, which says its global scales are amax / 448."""
    shutil.copytree(calibrated, out, ignore=shutil.ignore_patterns(PROVENANCE_FILE, VERIFY_DIR))
    scales = out / SCALES_FILE
    save_file(damage(load_file(scales)), scales)
    hf_quant = out / HF_QUANT_CONFIG
    if hf_quant.exists():
        meta = json.loads(hf_quant.read_text())
        if meta.get("quantization", {}).get("kv_cache_quant_algo") == "NVFP4":
            hf_quant.write_text(json.dumps({**meta, "producer": MODELOPT_PRODUCER}, indent=2) + "\n")
    return out


def outcome(model_dir: Path, report: Path, text: str, heldout_seed: int, args: argparse.Namespace) -> dict:
    data = DataRequest(text, num_samples=args.samples, seq_len=args.seq_len, seed=heldout_seed)
    clock = time.perf_counter()
    result = verify(VerifyRequest(model_dir, data=data, report_dir=report, device="cpu"))
    reasons = [r for r in result.report.reasons if r.level in (WARN, FAIL)]
    return {"verdict": result.verdict, "unit_warning": any(UNIT_WARNING in r.message for r in reasons),
            "reasons": [f"{r.level}: {r.message}" for r in reasons], "seconds": time.perf_counter() - clock,
            "paths": path_outcomes(result)}


def path_outcomes(result: VerifyResult) -> list[dict]:
    """Per NVFP4 engine path: its verdict, whether a finding says its global scale is 6x off (the loader's factor
    against the folder's convention: by design, not noise), whether it WARNed worse than global scale 1.0, and its
    mean KL to the bf16 cache with these scales and at global scale 1.0."""
    check = result.report.held_out.nvfp4
    if check is None:
        return []
    reasons = [r for r in result.report.reasons if r.level in (WARN, FAIL)]
    return [{"path": p.path, "verdict": p.verdict,
             "scale_finding": any(r.message.startswith(f"{p.path} runs the stored ") for r in reasons
                                  if p.path in r.engines),
             "unit_warning": any(UNIT_WARNING in r.message for r in reasons if p.path in r.engines),
             "kl_mean": p.accuracy.kl_mean, "kl_mean_unit": p.accuracy.kl_mean_unit}
            for p in check.paths]


def run_model(model: str, root: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    good = []
    for calib_seed in range(args.calib_seeds):
        out = root / f"{model}-good-{calib_seed}"
        data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples, seq_len=args.seq_len,
                           seed=calib_seed)
        calibrate(CalibrationRequest(model=model, out=out, data=data, kv_dtype=args.kv_dtype,
                                     convention=default_format(args.kv_dtype)))
        good.append(("good", f"calibration seed {calib_seed}", out))
    damaged = [("damaged", name, damaged_copy(good[0][2], root / f"{model}-{i}", damage))
               for i, (name, damage) in enumerate(DAMAGES[args.kv_dtype].items())]
    if args.kv_dtype == DEFAULT_KV_DTYPE:  # llm-compressor's observer writes fp8 scales
        data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples, seq_len=args.seq_len, seed=0)
        observer = root / f"{model}-last-batch"
        calibrate(CalibrationRequest(model=model, out=observer, data=data, strategy="last-batch", headroom=1.0,
                                     batch_size=1, layerwise=False))
        damaged.append(("damaged", "llm-compressor's observer", observer))
    for text in args.texts.split(","):
        for kind, case, folder in good + damaged:
            for heldout_seed in range(args.heldout_seeds):
                row = outcome(folder, root / "reports" / f"{folder.name}-{text}-{heldout_seed}", text, heldout_seed,
                              args)
                rows.append({"model": model, "text": text, "kind": kind, "case": case, "heldout_seed": heldout_seed,
                             **row})
                paths = "".join(f"; {p['path']}: {p['verdict']}" for p in row["paths"])
                print(f"  {model} {case} {text} held-out seed {heldout_seed}: {row['verdict']}{paths} "
                      f"({row['seconds']:.0f} s)")
    return rows


def judged(rows: list[dict]) -> list[dict]:
    """One entry per run and verdict: the run's for fp8 (one over every engine), each engine path's for NVFP4."""
    return [{**r, **p} for r in rows for p in r["paths"] or [{"path": "every engine", "scale_finding": False}]]


def table(rows: list[dict]) -> str:
    lines = ["| model | held-out text | checkpoint | case | engine path | runs | PASS | WARN | FAIL | finding: global "
             "scale 6x off | WARN: worse than unit scales |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    entries = judged(rows)
    key = ("model", "text", "kind", "case", "path")
    for case in dict.fromkeys(tuple(e[k] for k in key) for e in entries):
        chosen = [e for e in entries if tuple(e[k] for k in key) == case]
        count = {v: sum(e["verdict"] == v for e in chosen) for v in ("PASS", "WARN", "FAIL")}
        lines.append(f"| {' | '.join(case)} | {len(chosen)} | {count['PASS']} | {count['WARN']} | {count['FAIL']} | "
                     f"{sum(e['scale_finding'] for e in chosen)} | {sum(e['unit_warning'] for e in chosen)} |")
    good = [e for e in entries if e["kind"] == "good"]
    designed = sum(e["verdict"] != "PASS" and e["scale_finding"] for e in good)
    lines.append(f"\nGood checkpoints: {sum(e['verdict'] != 'PASS' for e in good)} of {len(good)} verdicts not PASS "
                 f"({designed} naming a global scale 6x off, by design; "
                 f"{sum(e['verdict'] != 'PASS' and not e['scale_finding'] for e in good)} otherwise), "
                 f"{sum(e['unit_warning'] for e in good)} WARNed worse than unit scales (stated rate: "
                 f"{load_thresholds().false_alarm_rate:.0%} per run). Damaged: "
                 f"{sum(e['verdict'] == 'PASS' for e in entries if e['kind'] == 'damaged')} PASS.")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--models", default="bundled,bundled-outliers")
    options.add_argument("--calib-seeds", type=int, default=3)
    options.add_argument("--heldout-seeds", type=int, default=4)
    options.add_argument("--samples", type=int, default=16)
    options.add_argument("--seq-len", type=int, default=128)
    options.add_argument("--texts", default="bundled", help=f"held-out texts, comma-separated: {', '.join(TEXTS)}")
    options.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, choices=tuple(DAMAGES))
    args = options.parse_args()
    unknown = set(args.texts.split(",")) - set(TEXTS)
    if unknown:
        options.error(f"--texts: {', '.join(sorted(unknown))} is not one of {', '.join(TEXTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8kv-false-alarms-") as root:
        for model in args.models.split(","):
            rows += run_model(model, Path(root), args)
    print(table(rows))
    common.write_results("verify_false_alarms" + ("" if args.kv_dtype == DEFAULT_KV_DTYPE else f"_{args.kv_dtype}"),
                         rows, args)


if __name__ == "__main__":
    main()
