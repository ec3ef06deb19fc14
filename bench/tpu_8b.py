"""On a TPU VM: verify an 8B-shaped random llama with the Pallas kernel; decode tokens/s and peak TPU memory.

Builds the checkpoint (bf16, ~16 GB, one shard per layer), calibrates it on the host CPU (few
samples: the scales only need to exist), then in one process per part: `fp8kv verify --device tpu
--json` (report.json's runtime section says whether the kernel ran), and bf16 vs fp8 decode tokens/s
through the runner. Peak memory is torch_xla's `peak_bytes_used` of the TPU.

    bash bench/tpu_8b.sh                         # writes $OUT/tpu_8b.json
    python bench/tpu_8b.py --root /tmp/x --device xla-cpu --smoke   # check the script without a TPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CAL_SAMPLES, CAL_SEQ_LEN = 16, 256
BATCH, PROMPT_LEN, DECODE_STEPS = 8, 512, 32


def _peak_gb(device) -> float | None:
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(device)
    except RuntimeError:  # XLA:CPU keeps no allocator statistics
        return None
    peak = info.get("peak_bytes_used", info.get("bytes_used"))
    return peak / 1e9 if peak is not None else None


def decode_part(model: Path, device: str, smoke: bool) -> dict:
    """bf16 then fp8 decode tokens/s through the runner, side by side (bench_runtime's workload)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_runtime import bench_one

    batch, prompt_len, steps = (2, 32, 4) if smoke else (BATCH, PROMPT_LEN, DECODE_STEPS)
    rows = [bench_one(model, device, "auto", dtype, batch, prompt_len, steps) for dtype in ("bf16", "fp8_e4m3")]
    from fp8kv.runtime.device import resolve_device

    return {"rows": rows, "fp8_over_bf16_decode": rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"],
            "peak_gb": _peak_gb(resolve_device(device).device)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--part", choices=["all", "decode"], default="all")
    parser.add_argument("--smoke", action="store_true", help="A 2-layer, hidden-256 model.")
    args = parser.parse_args()
    model, calibrated = args.root / "llama-8b-random", args.root / "llama-8b-fp8kv"
    if args.part == "decode":
        print(json.dumps(decode_part(calibrated, args.device, args.smoke)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_layerwise import LLAMA_8B, write_corpus, write_random_llama

    shape = dict(LLAMA_8B, num_layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512) if args.smoke else LLAMA_8B
    start = time.perf_counter()
    write_random_llama(model, **shape)
    corpus = write_corpus(args.root)
    fp8kv = [sys.executable, "-m", "fp8kv"]
    subprocess.run([*fp8kv, "calibrate", str(model), "--dataset", str(corpus), "--num-samples", str(CAL_SAMPLES),
                    "--seq-len", str(CAL_SEQ_LEN), "--device", "cpu", "--out", str(calibrated), "--overwrite"],
                   check=True)
    prepared = time.perf_counter() - start
    start = time.perf_counter()
    verify = subprocess.run([*fp8kv, "verify", str(calibrated), "--dataset", str(corpus), "--device", args.device,
                             "--json"], capture_output=True, text=True)
    verify_seconds = time.perf_counter() - start
    report = json.loads(verify.stdout) if verify.stdout.strip().startswith("{") else {"error": verify.stderr[-2000:]}
    decode = subprocess.run([sys.executable, __file__, "--root", str(args.root), "--device", args.device,
                             "--part", "decode", *(["--smoke"] if args.smoke else [])], capture_output=True, text=True)
    decode_result = (json.loads(decode.stdout.strip().splitlines()[-1]) if decode.returncode == 0
                     else {"error": decode.stderr[-2000:]})
    summary = {"device": args.device, "shape": shape, "date": time.strftime("%Y-%m-%d"), "prepare_seconds": prepared,
               "verify_seconds": verify_seconds, "verify_exit_code": verify.returncode,
               "verdict": report.get("verdict"), "runtime": report.get("runtime"), "engines": report.get("engines"),
               "decode": decode_result}
    print(json.dumps(summary, indent=2))
    if args.results:
        args.results.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
