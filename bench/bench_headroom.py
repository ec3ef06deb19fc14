"""How much margin above amax/MAX do static scales need to be safe on unseen text, and what does it cost?

For every model (the bundled model, the bundled outlier model, and a tiny random-weight checkpoint
of every factory architecture), calibrate on the bundled calibration split and measure on the
bundled held-out split (same distribution, never calibrated on), for each headroom:

- mean KL(bf16 || fp8) of next-token distributions and top-1 agreement with the bf16 cache, on the
  clamping engine; dKL is the paired difference to headroom 1.0 and 2se its noise;
- held-out K/V values with |x|/scale above the raw cast's limit (464 for e4m3), from the held-out
  |x| histograms, and the largest |x|/scale;
- NaN/inf values a raw (non-saturating) cast stored in the runtime's cache, and sequences lost.

Runs with no NaN stored are identical on both engines (clamp and raw differ only above 464), so the
clamp run is only repeated when the raw run stored NaN. Prints a table, writes bench/results/headroom.json.

    .venv/bin/python bench/bench_headroom.py [--calibration 64x512 16x128] [--heldout-samples 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_DIR
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint

import common  # bench/common.py
import kvcompare  # bench/kvcompare.py

HEADROOMS = (1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0)


def size(text: str) -> tuple[int, int]:
    """`64x512` -> (samples, tokens per sample)."""
    samples, _, tokens = text.partition("x")
    return int(samples), int(tokens)


def models(root: Path, architectures: list[str]) -> list[tuple[str, Path]]:
    found = [("bundled", BUNDLED_MODEL_DIR), ("bundled-outliers", BUNDLED_OUTLIERS_DIR)]
    return found + [(f"factory {arch}", make_checkpoint(arch, root / arch)) for arch in architectures]


def study(name: str, path: Path, args: argparse.Namespace) -> list[dict]:
    model = kvcompare.Model.open(path)
    rows = []
    for calibration in args.calibration:
        num_samples, seq_len = size(calibration)
        statistics = model.observe(model.data(BUNDLED_CALIBRATION_TEXT, num_samples, seq_len))
        # Held-out samples as long as the calibration samples: positions never calibrated are another question.
        held_data = model.data(BUNDLED_HELDOUT_TEXT, args.heldout_samples, seq_len)
        held = model.observe(held_data)
        samples = held_data.samples
        reference = model.run(samples, None)
        base = None
        for headroom in args.headrooms:
            _, scales = model.scales(statistics, headroom)
            ratio = kvcompare.max_ratio(model, held, scales)
            raw = model.run(samples, scales, "no-clamp")
            over = raw.nonfinite_stored  # values past the raw cast's limit: NaN/inf in the raw-cast cache
            clamp = model.run(samples, scales, "vllm-tpu") if raw.nonfinite_stored else raw
            scores, raw_scores = kvcompare.compare(samples, clamp, reference), kvcompare.compare(samples, raw, reference)
            base = base or scores
            rows.append({
                "model": name, "calibration": calibration, "heldout": f"{len(samples)}x{seq_len}", "headroom": headroom,
                "kl_mean": scores.kl_mean, "dkl_vs_1": scores.kl_mean - base.kl_mean,
                "dkl_2se": 2 * kvcompare.paired_se(scores, base), "top1": scores.top1, "ppl": scores.ppl,
                "heldout_over_raw_limit": over, "max_ratio": ratio,
                "raw_nan_stored": raw.nonfinite_stored, "raw_sequences_lost": raw_scores.sequences_lost,
                "sequences": len(samples),
            })
        print(f"  {name} {calibration}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | calibration / held-out | headroom | mean KL | dKL vs 1.0 (2se) | top-1 | held-out over 464 | "
            "max abs(x)/scale | raw: NaN stored / sequences lost |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['calibration']} / {r['heldout']} | {r['headroom']:g} | {r['kl_mean']:.3e} | "
            f"{r['dkl_vs_1']:+.1e} ({r['dkl_2se']:.1e}) | {r['top1']:.4f} | {r['heldout_over_raw_limit']} | "
            f"{r['max_ratio']:.1f} | {r['raw_nan_stored']} / {r['raw_sequences_lost']} of {r['sequences']} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict], shown: tuple[float, ...] = (1.0, 1.05, 1.1, 1.25, 1.5)) -> str:
    """One line per model and calibration size: values over 464 per headroom, the margin needed, KL at each end."""
    head = ("| model | calibration / held-out | held-out max abs(x) / calibration amax | values over 464 at "
            + " / ".join(f"{h:g}" for h in shown) + " | mean KL at 1.0 | dKL at 1.25 (2se) |")
    lines = [head, "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["calibration"]), []).append(r)
    for (model, calibration), group in groups.items():
        by = {r["headroom"]: r for r in group}
        over = " / ".join(str(by[h]["heldout_over_raw_limit"]) if h in by else "-" for h in shown)
        quarter = by.get(1.25)
        dkl = f"{quarter['dkl_vs_1']:+.1e} ({quarter['dkl_2se']:.1e})" if quarter else "-"
        lines.append(f"| {model} | {calibration} / {group[0]['heldout']} | {by[1.0]['max_ratio'] / 448:.3f} | "
                     f"{over} | {by[1.0]['kl_mean']:.2e} | {dkl} |")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--calibration", nargs="+", default=["64x512", "16x128"],
                         help="calibration sizes, SAMPLESxTOKENS (64x512: make demo's; 16x128: the tests')")
    options.add_argument("--heldout-samples", type=int, default=40,
                         help="held-out records (of 78 in the split), as long as the calibration samples")
    options.add_argument("--headrooms", nargs="+", type=float, default=list(HEADROOMS))
    options.add_argument("--architectures", nargs="*", default=list(ARCHITECTURES))
    options.add_argument("--device", default="cpu", help="recorded only: the study runs on the CPU")
    args = options.parse_args()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(Path(tmp), args.architectures):
            rows += study(name, path, args)
            # Written after every model, so a long run that is stopped keeps what it measured.
            common.write_results("headroom", rows, args, seconds=time.perf_counter() - started,
                                 threads=torch.get_num_threads())
    print(table(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()
