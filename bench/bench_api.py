"""fp8kv.api on a live model: what observing costs next to the model's own forward and generate.

For each model (SmolLM2-135M-Instruct from the `demo` extra, the bundled model), in one process and
interleaved `--repeats` times over exactly the same right-padded batches (the bundled corpus, tokenized
by each model's tokenizer as calibration tokenizes it):
  forward         `model(input_ids, attention_mask)`, the causal LM (LM head included), under no_grad
  base forward    `model.base_model(...)` with transformers' own cache: the work observe_model does, less the folding
  observe_model   `fp8kv.api.observe_model(model, batches)`
  generate        `model.generate` of `--prompts` left-padded prompts, `--new-tokens` greedy tokens
  observing       the same `generate` inside `fp8kv.api.observing(model)`
Ratios are of medians. Peak memory: each phase once in a fresh process (MALLOC_MMAP_THRESHOLD_ fixed, so freed
tensors leave the resident set), the resident set sampled every millisecond, minus the resident set just
before the phase. Prints a table and writes bench/results/api.json.

    .venv/bin/python bench/bench_api.py [--samples 16] [--seq-len 256] [--batch-size 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import psutil
import torch

from fp8kv import api
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.data import DataRequest, load_calibration_data, make_batches, pad_id
from fp8kv.models import BUNDLED_CALIBRATION_TEXT

import common  # bench/common.py

MODELS = ("smollm2", "bundled")
PROMPTS = ("Explain how a bicycle gear system works.", "Write a short story about a lighthouse keeper.",
           "Give three tips for learning a new language.", "Describe the water cycle to a child in a few sentences.")
PHASES = ("forward", "base_forward", "observe_model", "generate", "observing")


def load(name: str, args) -> tuple[Any, list[api.Batch], dict[str, torch.Tensor]]:
    """The model (its own dtype, eval), the calibration batches and the left-padded prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_calibration_data(DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples,
                                             seq_len=args.seq_len), tokenizer)
    batches = make_batches(data.samples, args.batch_size, pad_id(tokenizer))
    tokenizer.padding_side = "left"
    prompts = dict(tokenizer(list(PROMPTS[: args.prompts]), return_tensors="pt", padding=True))
    prompts["pad_token_id"] = pad_id(tokenizer)
    return model, batches, prompts


def phases(model: Any, batches: list[api.Batch], prompts: dict[str, Any], new_tokens: int) -> dict[str, Callable]:
    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)

    def base_forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True)

    def observe_model() -> None:
        api.observe_model(model, batches)

    def generate() -> None:
        model.generate(**prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def observing() -> None:
        with api.observing(model) as observation:
            generate()
        assert observation.num_tokens > 0

    return {"forward": forward, "base_forward": base_forward, "observe_model": observe_model,
            "generate": generate, "observing": observing}


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def peak_rss(run: Callable[[], None]) -> int:
    """Bytes the resident set grew to above where it stood before `run`, sampled every millisecond."""
    process, peak, done = psutil.Process(), [0], threading.Event()
    before = process.memory_info().rss

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], process.memory_info().rss) - before


def memory(name: str, phase: str, args) -> int:
    """The phase's peak above its start, in a fresh process of its own (see `peak_rss`)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    command = [sys.executable, __file__, "--memory-of", f"{name}:{phase}", *_forwarded(args)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak_bytes"])


def _forwarded(args) -> list[str]:
    return ["--samples", str(args.samples), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]


def bench_model(name: str, args) -> dict[str, Any]:
    model, batches, prompts = load(name, args)
    runs = phases(model, batches, prompts, args.new_tokens)
    for run in runs.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(args.repeats):
        for phase in PHASES:
            seconds[phase].append(timed(runs[phase]))
    median = {phase: statistics.median(values) for phase, values in seconds.items()}
    stats = api.observe_model(model, batches)
    geometry = api.model_geometry(model)
    return {
        "model": name, "dtype": str(model.dtype).removeprefix("torch."), "layers": geometry.num_layers,
        "kv_heads": geometry.num_kv_heads, "tokens": int(stats.tokens.max()),
        "padded_tokens": sum(b.input_ids.numel() for b in batches),
        "generated_tokens": args.prompts * args.new_tokens,
        **{f"{phase}_s": median[phase] for phase in PHASES},
        "observe_vs_forward": median["observe_model"] / median["forward"],
        "observe_vs_base_forward": median["observe_model"] / median["base_forward"],
        "observing_vs_generate": median["observing"] / median["generate"],
        "statistics_bytes": sum(t.numel() * t.element_size() for t in (stats.amax, stats.hist, stats.tokens)),
        **{f"{phase}_peak_mib": memory(name, phase, args) / 2**20 for phase in PHASES},
    }


def main() -> None:
    options = common.parser(__doc__.splitlines()[0])
    options.set_defaults(repeats=5)
    options.add_argument("--prompts", type=int, default=4)
    options.add_argument("--new-tokens", type=int, default=32)
    options.add_argument("--models", default=",".join(MODELS))
    options.add_argument("--memory-of", help=argparse.SUPPRESS)  # NAME:PHASE, the child of `memory`
    args = options.parse_args()
    if args.memory_of:
        name, phase = args.memory_of.split(":")
        model, batches, prompts = load(name, args)
        print(json.dumps({"peak_bytes": peak_rss(phases(model, batches, prompts, args.new_tokens)[phase])}))
        return
    load_before = os.getloadavg()
    rows = [bench_model(name, args) for name in args.models.split(",")]
    load_after = os.getloadavg()
    show(rows)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    del args.memory_of
    common.write_results("api", rows, args, load_average_before=load_before[0], load_average_after=load_after[0])


def show(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':8} {'tokens':>6} {'fwd s':>7} {'base s':>7} {'observe s':>9} {'×fwd':>5} {'×base':>5} "
          f"{'gen s':>6} {'observing s':>11} {'×gen':>5}")
    for r in rows:
        print(f"{r['model']:8} {r['tokens']:>6} {r['forward_s']:>7.3f} {r['base_forward_s']:>7.3f} "
              f"{r['observe_model_s']:>9.3f} {r['observe_vs_forward']:>5.2f} {r['observe_vs_base_forward']:>5.2f} "
              f"{r['generate_s']:>6.3f} {r['observing_s']:>11.3f} {r['observing_vs_generate']:>5.2f}")
    print("peak MiB above the loaded model (fresh process per phase); statistics size")
    for r in rows:
        peaks = "  ".join(f"{phase} {r[f'{phase}_peak_mib']:.1f}" for phase in PHASES)
        print(f"{r['model']:8} {peaks}  statistics {r['statistics_bytes'] / 2**20:.2f}")


if __name__ == "__main__":
    main()
