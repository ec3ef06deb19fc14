"""Layer-by-layer calibration: peak memory against depth, an 8B-shaped model, overlay against copy.

Every calibration runs the real CLI (`fp8kv calibrate ...`) in a fresh process, which reports
its own peak RSS (VmHWM) at exit. (`wait4`'s ru_maxrss would not do: Linux folds the forking
parent's RSS into the child's maximum at exec.)

    depth  factory llama (hidden 1024, bf16) at growing depth, whole-model and --layerwise
    speed  wall time of --layerwise against the whole-model path on a factory llama that fits (median of 3)
    big    an 8B-shaped random llama written to disk shard by shard (never held in RAM),
           calibrated with the automatic choice (layer by layer when it does not fit), then
           written with --mode overlay and --mode copy; the checkpoint is deleted afterwards
    build  only write the 8B-shaped checkpoint (used by bench/gpu_8b.sh)

    .venv/bin/python bench/bench_layerwise.py depth [--depths 2 4 8 16]
    .venv/bin/python bench/bench_layerwise.py speed [--layers 8] [--samples 16] [--seq-len 256]
    .venv/bin/python bench/bench_layerwise.py big [--root DIR] [--samples 4] [--seq-len 64]

Prints a table per part and merges its figures into bench/results/layerwise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "layerwise.json"
LLAMA_8B = dict(num_layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)


def write_corpus(folder: Path) -> Path:
    """Python's own documentation as jsonl records of 2000 characters (offline, identical everywhere)."""
    from pydoc_data.topics import topics

    path = folder / "corpus.jsonl"
    chunks = [topics[k][i : i + 2000] for k in sorted(topics) for i in range(0, len(topics[k]) - 1999, 2000)]
    path.write_text("".join(json.dumps({"text": chunk}) + "\n" for chunk in chunks))
    return path


# Runs the CLI with argv[1:], writing the process's peak RSS (kB) to $FP8KV_BENCH_HWM at exit.
WITH_HWM = """
import atexit, os, re, sys
def hwm():
    with open(os.environ["FP8KV_BENCH_HWM"], "w") as out:
        out.write(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
atexit.register(hwm)
if sys.argv[1:] == ["--imports-only"]:
    import fp8kv.calibrate.pipeline, transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
else:
    from fp8kv.cli import main
    sys.argv[0] = "fp8kv"
    main()
"""


def run_cli(args: list[str]) -> dict[str, Any]:
    """Run `fp8kv ARGS` in a fresh process: its wall time, peak RSS and JSON stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        hwm = Path(tmp) / "hwm"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", WITH_HWM, *args], capture_output=True,
                              env={**os.environ, "FP8KV_BENCH_HWM": str(hwm)})
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"fp8kv {' '.join(args)} failed:\n{done.stderr.decode()[-2000:]}")
        peak = int(hwm.read_text()) / 1024
    return {"seconds": seconds, "peak_rss_mb": peak, "summary": json.loads(done.stdout) if done.stdout else {}}


def baseline_rss_mb() -> float:
    """Peak RSS of a process that only imports what calibrate imports (the floor under every run)."""
    return run_cli(["--imports-only"])["peak_rss_mb"]


def calibrate_args(model: Path, corpus: Path, samples: int, seq_len: int, *extra: str) -> list[str]:
    return ["calibrate", str(model), "--dataset", str(corpus), "--num-samples", str(samples), "--seq-len",
            str(seq_len), "--batch-size", str(samples), "--device", "cpu", "--json", *extra]


def bench_depth(depths: list[int], hidden: int, samples: int, seq_len: int) -> dict[str, Any]:
    """Peak RSS of whole-model and layer-by-layer calibration of factory llamas of growing depth."""
    from fp8kv.checkpoint.source import SourceCheckpoint
    from fp8kv.calibrate.layerwise import weight_bytes
    from fp8kv.tools.factory import make_checkpoint

    floor = baseline_rss_mb()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp))
        for depth in depths:
            model = make_checkpoint("llama", Path(tmp) / f"llama{depth}", num_layers=depth, hidden_size=hidden,
                                    num_heads=16, num_kv_heads=4, dtype=torch.bfloat16)
            row = {"layers": depth, "weights_mb": weight_bytes(SourceCheckpoint.open(model)) / 2**20}
            scales = {}
            for name, flag in (("whole", "--no-layerwise"), ("layerwise", "--layerwise")):
                run = run_cli(calibrate_args(model, corpus, samples, seq_len, flag))
                row[f"{name}_peak_rss_mb"] = run["peak_rss_mb"]
                row[f"{name}_seconds"] = run["seconds"]
                scales[name] = [(r["k_scale"], r["v_scale"]) for r in run["summary"]["layers"]]
            row["scales_identical"] = scales["whole"] == scales["layerwise"]
            row.update({f"write_{m}_seconds": t for m, t in write_times(model, Path(tmp), depth).items()})
            rows.append(row)
            shutil.rmtree(model)
    print(f"\npeak RSS (MB) by depth: factory llama, hidden {hidden}, bf16, {samples} x {seq_len} tokens; "
          f"import floor {floor:.0f} MB")
    print(f"{'layers':>6} {'weights':>8} {'whole':>8} {'layerwise':>10} {'whole s':>8} {'layerw. s':>9} {'same scales':>11}"
          f" {'overlay s':>9} {'copy s':>7}")
    for r in rows:
        print(f"{r['layers']:>6} {r['weights_mb']:>8.0f} {r['whole_peak_rss_mb']:>8.0f} {r['layerwise_peak_rss_mb']:>10.0f} "
              f"{r['whole_seconds']:>8.1f} {r['layerwise_seconds']:>9.1f} {str(r['scales_identical']):>11}"
              f" {r['write_overlay_seconds']:>9.3f} {r['write_copy_seconds']:>7.3f}")
    return {"hidden": hidden, "samples": samples, "seq_len": seq_len, "import_floor_mb": floor, "rows": rows}


def bench_speed(layers: int, hidden: int, samples: int, seq_len: int, repeats: int) -> dict[str, Any]:
    """Wall time of whole-model and --layerwise calibration of one factory llama: median of `repeats` fresh
    processes each (alternating, so a load change on the machine hits both), and their ratio."""
    import statistics

    from fp8kv.tools.factory import make_checkpoint

    seconds: dict[str, list[float]] = {"whole": [], "layerwise": []}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp))
        model = make_checkpoint("llama", Path(tmp) / "llama", num_layers=layers, hidden_size=hidden, num_heads=16,
                                num_kv_heads=4, dtype=torch.bfloat16)
        for _ in range(repeats):
            for name, flag in (("whole", "--no-layerwise"), ("layerwise", "--layerwise")):
                seconds[name].append(run_cli(calibrate_args(model, corpus, samples, seq_len, flag))["seconds"])
    median = {name: statistics.median(times) for name, times in seconds.items()}
    ratio = median["layerwise"] / median["whole"]
    print(f"\nwall time (s), factory llama {layers}x{hidden}, bf16, {samples} x {seq_len} tokens, "
          f"median of {repeats} processes each")
    print(f"  whole-model {median['whole']:.1f} {seconds['whole']}\n  --layerwise {median['layerwise']:.1f} "
          f"{seconds['layerwise']}\n  ratio {ratio:.3f} (target <= 1.15)")
    return {"layers": layers, "hidden": hidden, "samples": samples, "seq_len": seq_len, "seconds": seconds,
            "median_seconds": median, "layerwise_over_whole": ratio}


def write_random_llama(out: Path, num_layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                       vocab: int, device: str = "cpu", seed: int = 0) -> Path:
    """A random bf16 llama checkpoint, one safetensors shard per decoder layer (plus one for embeddings/head).

    Tensors are drawn and written shard by shard, so memory holds at most one shard (~1 GB).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from fp8kv.tools.factory import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    head_dim = hidden // heads
    config = LlamaConfig(
        num_hidden_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, head_dim=head_dim, max_position_embeddings=8192,
        rope_theta=500000.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="bfloat16", tie_word_embeddings=False,
    )
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:  # std 0.02, as initialised LLMs are
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=generator).cpu()

    def norm(size: int) -> torch.Tensor:  # around 1, with a spread
        return (torch.rand(size, generator=generator, device=device) + 0.5).to(torch.bfloat16).cpu()

    shards = {"embed": {"model.embed_tokens.weight": draw(vocab, hidden), "model.norm.weight": norm(hidden),
                        "lm_head.weight": draw(vocab, hidden)}}
    weight_map: dict[str, str] = {}
    total = num_layers + 1
    for index in range(-1, num_layers):
        name = f"model-{index + 2:05d}-of-{total:05d}.safetensors"
        if index < 0:
            tensors = shards.pop("embed")
        else:
            p = f"model.layers.{index}."
            tensors = {
                p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
                p + "self_attn.q_proj.weight": draw(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": draw(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": draw(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": draw(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": draw(intermediate, hidden), p + "mlp.up_proj.weight": draw(intermediate, hidden),
                p + "mlp.down_proj.weight": draw(hidden, intermediate),
            }
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    size = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index_json = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return out


def bench_big(root: Path, samples: int, seq_len: int, keep: bool) -> dict[str, Any]:
    """Build the 8B-shaped llama, calibrate it (automatic choice), time overlay and copy writes."""
    from fp8kv.calibrate.layerwise import available_memory, choose_layerwise, weight_bytes
    from fp8kv.checkpoint.source import SourceCheckpoint

    root.mkdir(parents=True, exist_ok=True)
    model = root / "llama-8b-random"
    result: dict[str, Any] = {"shape": LLAMA_8B, "samples": samples, "seq_len": seq_len}
    try:
        start = time.perf_counter()
        write_random_llama(model, **LLAMA_8B)
        result["build_seconds"] = time.perf_counter() - start
        source = SourceCheckpoint.open(model)
        result["weights_gb"] = weight_bytes(source) / 1e9
        result["available_ram_gb"] = available_memory() / 1e9
        result["automatic_choice_layerwise"] = choose_layerwise(None, source)
        corpus = write_corpus(root)
        run = run_cli(calibrate_args(model, corpus, samples, seq_len, "--out", str(root / "overlay")))
        result["calibrate_seconds"] = run["seconds"]
        result["calibrate_peak_rss_gb"] = run["peak_rss_mb"] / 1024
        result["num_tokens"] = run["summary"]["dataset"]["num_tokens"]
        result["k_scale_range"] = [min(r["k_scale"] for r in run["summary"]["layers"]),
                                   max(r["k_scale"] for r in run["summary"]["layers"])]
        start = time.perf_counter()
        source.content_hash()
        result["content_hash_seconds"] = time.perf_counter() - start  # part of calibrate: fp8kv.json records it
        result["write_seconds"] = write_times(model, root, LLAMA_8B["num_layers"])
    finally:
        if not keep:
            shutil.rmtree(model, ignore_errors=True)
            shutil.rmtree(root / "overlay", ignore_errors=True)
    print(f"\n8B-shaped random llama ({result.get('weights_gb', 0):.1f} GB bf16), {samples} x {seq_len} tokens, "
          f"{os.cpu_count()} cores, {result.get('available_ram_gb', 0):.1f} GB available")
    for key in ("build_seconds", "automatic_choice_layerwise", "calibrate_seconds", "calibrate_peak_rss_gb",
                "content_hash_seconds", "write_seconds"):
        print(f"  {key:28} {result.get(key)}")
    return result


def write_times(model: Path, root: Path, num_layers: int) -> dict[str, float]:
    """Seconds to write the calibrated checkpoint with --mode overlay and --mode copy (same scales)."""
    from fp8kv.checkpoint.kvscales import KVScales
    from fp8kv.checkpoint.writer import write_checkpoint

    layers = range(num_layers)
    scales = KVScales.from_floats(dict.fromkeys(layers, 0.01), dict.fromkeys(layers, 0.005))
    times = {}
    for mode in ("overlay", "copy"):
        out = root / f"write-{mode}"
        start = time.perf_counter()
        write_checkpoint(model, out, scales, mode=mode, overwrite=True)
        times[mode] = time.perf_counter() - start
        shutil.rmtree(out)
    return times


def save(part: str, figures: dict[str, Any]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data[part] = {**figures, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {RESULTS} [{part}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["depth", "speed", "big", "build"])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "fp8kv-bench-8b")
    parser.add_argument("--layers", type=int, default=8, help="Depth of the llama speed times.")
    parser.add_argument("--repeats", type=int, default=3, help="Processes per mode (speed).")
    parser.add_argument("--keep", action="store_true", help="Keep the 8B-shaped checkpoint (big).")
    parser.add_argument("--device", default="cpu", help="Where build draws the random tensors.")
    args = parser.parse_args()
    if args.part == "depth":
        save("depth", bench_depth(args.depths, args.hidden, args.samples, args.seq_len))
    elif args.part == "speed":
        save("speed", bench_speed(args.layers, args.hidden, args.samples, args.seq_len, args.repeats))
    elif args.part == "big":
        save("llama_8b_shape", bench_big(args.root, args.samples, args.seq_len, args.keep))
    else:
        print(write_random_llama(args.root, **LLAMA_8B, device=args.device))


if __name__ == "__main__":
    main()
