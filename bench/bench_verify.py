"""Verify wall time against a plain transformers forward over exactly the same evaluation tokens.

(a) plain: load the causal LM (transformers' default attention) and run `model(input_ids,
attention_mask)` over the held-out samples in right-padded batches; (b) verify: the whole
`fp8kv.verify.run.verify` call on a checkpoint calibrated by fp8kv (static checks, bf16 / fp8 /
unit-scale caches and every released engine model over the same samples, greedy generations, report).
Both load their models inside the timed region and run in this process, interleaved, `--repeats`
times after one warm-up each; the ratio is median(b) / median(a). Prints a table and writes
bench/results/verify.json, with verify's own per-phase timings.

    .venv/bin/python bench/bench_verify.py [--samples 16] [--seq-len 256] [--device cpu]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fp8kv.data import DataRequest, load_calibration_data, make_batches
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.data import pad_id
from fp8kv.models import BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR
from fp8kv.verify.report import VerifyReport
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import verify

import common  # bench/common.py


def texts(folder: Path) -> tuple[Path, Path]:
    """(calibration, held-out) text: the bundled splits when built, else two halves of Python's docs."""
    from fp8kv.models import BUNDLED_CALIBRATION_TEXT

    if BUNDLED_HELDOUT_TEXT.is_file() and BUNDLED_CALIBRATION_TEXT.is_file():
        return BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT
    from pydoc_data.topics import topics

    keys = sorted(topics)
    paths = folder / "calibration.jsonl", folder / "heldout.jsonl"
    for path, part in zip(paths, (keys[::2], keys[1::2])):
        path.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in part))
    return paths


def plain_forward(model_dir: Path, data_path: Path, args) -> float:
    """Load the model and tokenizer, tokenize, and run one forward over every sample."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = load_calibration_data(DataRequest(str(data_path), num_samples=args.samples, seq_len=args.seq_len), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(args.device).eval()
    with torch.no_grad():
        for batch in make_batches(data.samples, args.batch_size, pad_id(tokenizer)):
            model(input_ids=batch.input_ids.to(args.device), attention_mask=batch.attention_mask.to(args.device))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_verify(model_dir: Path, data_path: Path, args, report_dir: Path) -> tuple[float, VerifyReport]:
    request = VerifyRequest(
        model_dir, data=DataRequest(str(data_path), num_samples=args.samples, seq_len=args.seq_len),
        batch_size=args.batch_size, device=args.device, report_dir=report_dir,
    )
    start = time.perf_counter()
    result = verify(request)
    return time.perf_counter() - start, result.report


def bench_model(name: str, source: Path, folder: Path, args) -> dict:
    calibration_text, heldout_text = texts(folder)
    out = folder / f"{source.name}-fp8kv"
    calibrate(CalibrationRequest(model=str(source), out=out, device=args.device, batch_size=args.batch_size,
                                 data=DataRequest(str(calibration_text), num_samples=args.samples, seq_len=args.seq_len)))
    plain_forward(out, heldout_text, args)  # warm-up: imports, kernels, page cache
    run_verify(out, heldout_text, args, folder / "report")
    plain_s, verify_s, report = [], [], None
    for _ in range(args.repeats):
        plain_s.append(plain_forward(out, heldout_text, args))
        seconds, report = run_verify(out, heldout_text, args, folder / "report")
        verify_s.append(seconds)
    return {
        "model": name,
        "samples": report.held_out.num_samples,
        "tokens": report.held_out.num_tokens,
        "plain_forward_s": statistics.median(plain_s),
        "verify_s": statistics.median(verify_s),
        "ratio": statistics.median(verify_s) / statistics.median(plain_s),
        "verify_phases_s": report.timings_s,
        "verdict": report.verdict,
    }


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llama = common.larger_llama(Path(tmp))
        rows.append(bench_model(common.LARGER_LLAMA_NAME, llama, Path(tmp), args))
        if (BUNDLED_MODEL_DIR / "config.json").is_file():
            rows.append(bench_model("bundled", BUNDLED_MODEL_DIR, Path(tmp), args))
    print(f"{'model':34} {'tokens':>7} {'plain s':>8} {'verify s':>9} {'ratio':>6}  phases (s)")
    for r in rows:
        phases = " ".join(f"{k}={v:.2f}" for k, v in r["verify_phases_s"].items())
        print(f"{r['model']:34} {r['tokens']:>7} {r['plain_forward_s']:>8.3f} {r['verify_s']:>9.3f} "
              f"{r['ratio']:>6.2f}  {phases}")
    common.write_results("verify", rows, args, goal_ratio=3.0)


if __name__ == "__main__":
    main()
