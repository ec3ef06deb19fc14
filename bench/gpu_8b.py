"""On a CUDA machine: an 8B-shaped random llama calibrated whole-model and layer by layer.

Builds the checkpoint (bf16, ~16 GB, tensors drawn on the GPU and written shard by shard),
then runs each observation path in its own process (so peak GPU memory is its own) over the
same samples, and reports tokens/s (weight loading included: that is what a user waits for),
peak GPU memory, peak host RSS, and whether the two paths gave identical scales.

    bash bench/gpu_8b.sh            # sets up the import path, writes $OUT/gpu_8b.json
    python bench/gpu_8b.py all --root /tmp/x --results out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SAMPLES, SEQ_LEN, BATCH = 64, 512, 8


def observe_once(model: Path, corpus: Path, mode: str, device: str) -> dict:
    """One observation (whole or layerwise) on `device`; figures for this process alone."""
    from fp8kv.calibrate import layerwise
    from fp8kv.data import DataRequest, load_calibration_data
    from fp8kv.calibrate.pipeline import CalibrationRequest, observe_whole_model
    from fp8kv.data import load_tokenizer
    from fp8kv.calibrate.scales import compute_scales
    from fp8kv.checkpoint.source import SourceCheckpoint

    source = SourceCheckpoint.open(model)
    tokenizer = load_tokenizer(source.path, False)
    request = CalibrationRequest(model=str(model), data=DataRequest(str(corpus), num_samples=SAMPLES, seq_len=SEQ_LEN),
                                 batch_size=BATCH, device=device)
    data = load_calibration_data(request.data, tokenizer)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if mode == "layerwise":
        stats = layerwise.observe_layerwise(source, data, request, tokenizer)
    else:
        stats = observe_whole_model(source, data, request, tokenizer)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    table = compute_scales(stats, source.geometry.kv_layers)
    return {
        "mode": mode, "seconds": seconds, "tokens": data.num_tokens, "tokens_per_s": data.num_tokens / seconds,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0,
        "peak_host_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "scales": table.scales.flatten().tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["all", "observe"])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--mode", choices=["whole", "layerwise"])
    parser.add_argument("--results", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="A 2-layer, hidden-256 model: check the script on a CPU.")
    args = parser.parse_args()
    model, corpus = args.root / "llama-8b-random", args.root / "corpus.jsonl"
    if args.part == "observe":
        print(json.dumps(observe_once(model, corpus, args.mode, args.device)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_layerwise import LLAMA_8B, write_corpus, write_random_llama

    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    shape = dict(LLAMA_8B, num_layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512) if args.smoke else LLAMA_8B
    print(f"{name}, torch {torch.__version__}, shape {shape}", flush=True)
    start = time.perf_counter()
    write_random_llama(model, **shape, device=args.device)
    write_corpus(args.root)
    build = time.perf_counter() - start
    print(f"built {model} in {build:.0f} s", flush=True)
    runs = []
    for mode in ("whole", "layerwise"):
        done = subprocess.run([sys.executable, __file__, "observe", "--root", str(args.root), "--mode", mode,
                               "--device", args.device],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:])
            runs.append({"mode": mode, "error": done.stderr[-500:]})
            continue
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ok = [r for r in runs if "error" not in r]
    same = len(ok) == 2 and ok[0]["scales"] == ok[1]["scales"]
    print(f"\n8B-shaped random llama, {SAMPLES} x {SEQ_LEN} tokens, batch {BATCH}, on {name}")
    print(f"{'mode':>10} {'seconds':>8} {'tokens/s':>9} {'peak GPU GB':>11} {'host RSS GB':>11}")
    for r in ok:
        print(f"{r['mode']:>10} {r['seconds']:>8.1f} {r['tokens_per_s']:>9.0f} {r['peak_gpu_gb']:>11.2f} {r['peak_host_rss_gb']:>11.2f}")
    print(f"identical scales: {same}")
    summary = {"device": name, "shape": shape, "date": time.strftime("%Y-%m-%d"), "build_seconds": build,
               "samples": SAMPLES, "seq_len": SEQ_LEN, "batch_size": BATCH, "identical_scales": same,
               "runs": [{k: v for k, v in r.items() if k != "scales"} for r in runs]}
    if args.results:
        args.results.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
