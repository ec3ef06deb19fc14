"""Does fp8kv's `vllm-cpu` engine model store the bytes vLLM's CPU build stores? Asked of vLLM's own kernel.

Runs in vLLM's venv (bench/vllm_venv.sh), with the repository importable as `fp8kv` (bench/cpu_conformance.sh
sets that up), on an x86 CPU with AVX-512 or AMX (vLLM's CPU fp8 cache needs one):

    bench/.vllm-venv/bin/python bench/vllm_cpu_write.py --out bench/results/vllm_cpu_write.json

Feeds K/V values of every magnitude (and the edge cases: ±MAX, past it, ±inf, NaN, ±0, subnormals) through
`cpu_attn_reshape_and_cache`, the op vLLM's CPU attention writes its cache with, for e4m3 and e5m2 caches,
bf16 and float32 inputs and several scales, and compares each stored byte with `vllm-cpu`'s and, for
contrast, with `vllm-cuda`'s (round to nearest). Prints a table; writes the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

HEAD_DIM, BLOCK = 64, 32
EDGES = [448.0, -448.0, 464.0, 465.0, 1000.0, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 57344.0,
         61440.0, 1e6, 2.0**-9, 2.0**-10, 2.0**-9 - 2.0**-30, -(2.0**-10), 2.0**-16, 2.0**-17, 3 * 2.0**-17]


def values(count: int, seed: int) -> torch.Tensor:
    """K/V values from 1e-4 to 1e3 in magnitude, then the edge cases."""
    generator = torch.Generator().manual_seed(seed)
    spread = torch.randn(count, generator=generator) * torch.logspace(-4, 3, count)
    return torch.cat([spread, torch.tensor(EDGES)])


def vllm_bytes(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """What vLLM's CPU kernel stores for `x` (flat) as values, with k_scale = v_scale = `scale`."""
    from vllm import _custom_ops as ops

    tokens = -(-x.numel() // HEAD_DIM)
    padded = torch.nn.functional.pad(x, (0, tokens * HEAD_DIM - x.numel())).view(tokens, 1, HEAD_DIM)
    blocks = -(-tokens // BLOCK)
    key_cache = torch.zeros(blocks, 1, BLOCK, HEAD_DIM, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    ops.cpu_attn_reshape_and_cache(padded.clone(), padded.clone(), key_cache, value_cache,
                                   torch.arange(tokens, dtype=torch.int64), "vec", k_scale=scale, v_scale=scale,
                                   kv_cache_dtype=kv_cache_dtype)
    # the value cache is row-major per block: [block, head, slot, head_dim]
    return value_cache[:, 0].reshape(-1, HEAD_DIM)[:tokens].reshape(-1)[: x.numel()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000, help="Random values per case (edge cases added).")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_cpu_write.json")
    args = parser.parse_args()

    import vllm

    from fp8kv.engine_models import engine_model
    from fp8kv.fp8 import FP8_DTYPES

    rows = []
    for kv_cache_dtype, kv in (("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
        for dtype in (torch.bfloat16, torch.float32):
            for scale in (1.0, 0.0123, 0.37, 3.5):
                x = values(args.count, seed=len(rows)).to(dtype)
                stored = vllm_bytes(x, scale, kv_cache_dtype)
                s = torch.tensor(scale, dtype=torch.float32)
                row = {"cache": kv, "input": str(dtype).removeprefix("torch."), "scale": scale, "values": x.numel()}
                for name in ("vllm-cpu", "vllm-cuda"):
                    model = engine_model(name).write(x.view(-1, 1), s, FP8_DTYPES[kv]).view(torch.uint8).view(-1)
                    row[f"{name} differs"] = int((model != stored).sum())
                rows.append(row)
    header = f"{'cache':9} {'input':9} {'scale':>7} {'values':>8} {'vllm-cpu differs':>17} {'vllm-cuda differs':>18}"
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(header)
    for r in rows:
        print(f"{r['cache']:9} {r['input']:9} {r['scale']:>7g} {r['values']:>8} {r['vllm-cpu differs']:>17} "
              f"{r['vllm-cuda differs']:>18}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    if any(r["vllm-cpu differs"] for r in rows):
        raise SystemExit("vllm-cpu's model differs from vLLM's CPU kernel")


if __name__ == "__main__":
    main()
