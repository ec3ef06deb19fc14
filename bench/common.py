"""What the calibrate and verify benchmarks share: their options, their larger model, their JSON output."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    """Options of a forward-ratio benchmark: samples, sequence length, batch, repeats, device."""
    options = argparse.ArgumentParser(description=description)
    options.add_argument("--samples", type=int, default=16)
    options.add_argument("--seq-len", type=int, default=256)
    options.add_argument("--batch-size", type=int, default=4)
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--device", default="cpu")
    return options


def larger_llama(root: Path) -> Path:
    """The factory llama the benchmarks measure besides the bundled model: 8 layers, hidden 1024, vocab 32k."""
    from fp8kv.tools.factory import make_checkpoint

    return make_checkpoint("llama", root / "llama", num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8,
                           vocab_size=32000, intermediate_size=2816)


LARGER_LLAMA_NAME = "factory llama 8x1024, vocab 32k"


def gemma3_shape(root: Path) -> Path:
    """Gemma-3-270M's shape with random bf16 weights, the 262k-vocabulary model the verify timings measure: 18 layers,
    hidden 640, 4 query heads on 1 KV head of 256 dims, MLP 2048, sliding window 512."""
    import torch

    from fp8kv.tools.factory import make_checkpoint

    return make_checkpoint("gemma3", root / "gemma3-shape", num_layers=18, hidden_size=640, num_heads=4,
                           num_kv_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144,
                           dtype=torch.bfloat16, sliding_window=512)


def write_results(name: str, rows: list[dict[str, Any]], args: argparse.Namespace, **meta: Any) -> Path:
    """bench/results/NAME.json with the rows and what they were measured on."""
    import torch  # here, not at the top: the benchmarks of torch-free commands keep their own process torch-free

    from fp8kv.runtime.linear import cpu_kernels

    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": getattr(args, "device", "cpu"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), **cpu_kernels(), **meta, **vars(args)}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path

