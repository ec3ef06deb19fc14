"""vLLM CPU amx's attention as verify reproduces it, against the exact read: one prefill's attention call of one layer.

    .venv/bin/python bench/bench_amx_attention.py [--repeats 7]

Per model shape (8 sequences x 256 tokens over an e4m3 cache): milliseconds per call (median) of the float32
attention (every other engine's read), the amx attention with its tile sums compiled (`runtime/amx_tiles.c`) and
the same in torch, and how many float32 calls each costs. Writes bench/results/amx_attention.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from fp8kv.runtime import amx_tiles
from fp8kv.runtime.attention import ragged_paged_attention

import common  # bench/common.py

# (KV heads, query heads per KV head, head dim) of the models bench/real_process.py times
SHAPES = {"smollm2": (3, 3, 64), "gemma3-shape": (1, 4, 256)}
SEQUENCES, TOKENS, PAGE = 8, 256, 16


def prefill_call(kv_heads: int, group: int, dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    pages = SEQUENCES * TOKENS // PAGE
    kv = torch.randn(pages + 1, PAGE, 2 * kv_heads, dim, generator=g).mul(2).to(torch.float8_e4m3fn)
    return dict(q=torch.randn(SEQUENCES * TOKENS, kv_heads * group, dim, generator=g).to(torch.bfloat16), kv_pages=kv,
                kv_lens=torch.full((SEQUENCES,), TOKENS, dtype=torch.int32),
                page_indices=torch.arange(1, pages + 1, dtype=torch.int32).reshape(SEQUENCES, -1),
                cu_q_lens=torch.arange(0, SEQUENCES * TOKENS + 1, TOKENS, dtype=torch.int32),
                num_seqs=torch.tensor([SEQUENCES], dtype=torch.int32), sm_scale=dim**-0.5, k_scale=0.05, v_scale=0.02)


def median_ms(call: dict, numerics: str, repeats: int) -> float:
    ragged_paged_attention(**call, numerics=numerics)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ragged_paged_attention(**call, numerics=numerics)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--repeats", type=int, default=7)
    args = options.parse_args()
    route = amx_tiles.tile_sums_route()
    if not route.startswith("compiled"):
        sys.exit(f"the tile sums cannot be compiled here, nothing to compare: {route}")
    rows = []
    print(f"one prefill attention call, {SEQUENCES} x {TOKENS} tokens, e4m3 cache, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}\n")
    print("| shape | float32 ms | amx compiled ms | amx torch ms | compiled / float32 | torch / float32 |\n"
          "|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        call = prefill_call(*shape)
        exact = median_ms(call, "float32", args.repeats)
        compiled = median_ms(call, "vllm-cpu-amx", args.repeats)
        kernel = amx_tiles._kernel
        amx_tiles._kernel = lambda: (None, "in torch on purpose")  # type: ignore[assignment]
        try:
            in_torch = median_ms(call, "vllm-cpu-amx", args.repeats)
        finally:
            amx_tiles._kernel = kernel
        rows.append({"shape": name, "float32_ms": exact, "amx_compiled_ms": compiled, "amx_torch_ms": in_torch})
        print(f"| {name} | {exact:.1f} | {compiled:.1f} | {in_torch:.1f} | {compiled / exact:.2f} | "
              f"{in_torch / exact:.2f} |")
    common.write_results("amx_attention", rows, args, load_average=os.getloadavg(), tile_sums=route)
    return 0


if __name__ == "__main__":
    sys.exit(main())
