"""Calibration time against a plain transformers forward over exactly the same tokens.

For each model: the same right-padded batches go through (a) `model(input_ids, attention_mask)`
of the causal LM with transformers' default attention, and (b) fp8kv's observation (base model,
no LM head, K/V statistics folded per layer) followed by the scale math. Both run in this
process, interleaved, `--repeats` times; the ratio is median(b) / median(a). Peak RSS is the
process's. Prints a table and writes bench/results/calibrate.json.

    .venv/bin/python bench/bench_calibrate.py [--samples 16] [--seq-len 256] [--device cpu]
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fp8kv.data import DataRequest, load_calibration_data, make_batches
from fp8kv.observe import KVStatistics, observe_batch
from fp8kv.checkpoint.load import load_language_model
from fp8kv.data import pad_id
from fp8kv.runtime.device import resolve_device
from fp8kv.calibrate.scales import compute_scales
from fp8kv.geometry import AttentionGeometry, read_config
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_MODEL_DIR

import common  # bench/common.py


def corpus(folder: Path) -> Path:
    """The bundled calibration corpus, or Python's own documentation when it is not built yet."""
    if BUNDLED_CALIBRATION_TEXT.is_file():
        return BUNDLED_CALIBRATION_TEXT
    from pydoc_data.topics import topics

    path = folder / "pydoc.jsonl"
    path.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    return path


def plain_forward(model, batches, device) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    _sync(device)
    return time.perf_counter() - start


def calibration(model, batches, geometry: AttentionGeometry, device) -> float:
    start = time.perf_counter()
    stats = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, device)
    with torch.no_grad():
        for batch in batches:
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            observe_batch(model.base_model, ids, mask, stats, frozenset(geometry.kv_layers))
    compute_scales(stats, geometry.kv_layers)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_model(name: str, model_dir: Path, data_path: Path, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(args.device, torch_only=True).device
    config = read_config(model_dir)
    geometry = AttentionGeometry.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    request = DataRequest(dataset=str(data_path), num_samples=args.samples, seq_len=args.seq_len)
    data = load_calibration_data(request, tokenizer)
    batches = make_batches(data.samples, args.batch_size, pad_id(tokenizer))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    observing = load_language_model(model_dir, device)
    plain_forward(plain, batches[:1], device)  # warm-up both paths
    calibration(observing, batches[:1], geometry, device)
    plain_s, calib_s = [], []
    for _ in range(args.repeats):
        plain_s.append(plain_forward(plain, batches, device))
        calib_s.append(calibration(observing, batches, geometry, device))
    return {
        "model": name,
        "layers": geometry.num_layers,
        "hidden": geometry.hidden_size,
        "vocab": geometry.vocab_size,
        "samples": len(data.samples),
        "tokens": data.num_tokens,
        "padded_tokens": sum(b.input_ids.numel() for b in batches),
        "plain_forward_s": statistics.median(plain_s),
        "calibration_s": statistics.median(calib_s),
        "ratio": statistics.median(calib_s) / statistics.median(plain_s),
    }


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_path = corpus(Path(tmp))
        llama = common.larger_llama(Path(tmp))
        rows.append(bench_model(common.LARGER_LLAMA_NAME, llama, data_path, args))
        if (BUNDLED_MODEL_DIR / "config.json").is_file():
            rows.append(bench_model("bundled", BUNDLED_MODEL_DIR, data_path, args))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'model':34} {'tokens':>7} {'plain s':>8} {'calib s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:34} {r['tokens']:>7} {r['plain_forward_s']:>8.3f} {r['calibration_s']:>8.3f} {r['ratio']:>6.3f}")
    print(f"peak RSS of the process: {peak_rss_mib:.0f} MiB")
    common.write_results("calibrate", rows, args, peak_rss_mib=peak_rss_mib)


if __name__ == "__main__":
    main()
