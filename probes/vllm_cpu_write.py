"""Does fp8kv's `vllm-cpu` engine model store the bytes vLLM's CPU build stores? Asked of vLLM's own kernel.

Runs in vLLM's venv (probes/vllm_venv.sh), with the repository importable as `fp8kv` (probes/cpu_conformance.sh
sets that up), on an x86 CPU with AVX-512 or AMX (vLLM's CPU fp8 cache needs one):

    bench/.vllm-venv/bin/python probes/vllm_cpu_write.py --out bench/results/vllm_cpu_write.json

Feeds K/V values of every magnitude (and the edge cases: ±MAX, past it, ±inf, NaN, ±0, subnormals) through
`cpu_attn_reshape_and_cache`, the op vLLM's CPU attention writes its cache with, for e4m3 and e5m2 caches,
bf16 and float32 inputs and several scales, and compares each stored byte with `vllm-cpu`'s and, for
contrast, with `vllm-cuda`'s (round to nearest). Prints a table; writes the counts as JSON.

The op takes the attention path's name (`isa`), and each path may store differently: every path runs, each in a
child process, so a path this CPU cannot run (`amx` without AMX tiles dies of an illegal instruction) is recorded
with the signal or error it ended with instead of its rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HEAD_DIM, BLOCK = 64, 32
ISAS = ("vec", "amx")  # the x86 paths of vLLM CPU's attention that take an fp8 cache
EDGES = [448.0, -448.0, 464.0, 465.0, 1000.0, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 57344.0,
         61440.0, 1e6, 2.0**-9, 2.0**-10, 2.0**-9 - 2.0**-30, -(2.0**-10), 2.0**-16, 2.0**-17, 3 * 2.0**-17]


def values(count: int, seed: int) -> torch.Tensor:
    """K/V values from 1e-4 to 1e3 in magnitude, then the edge cases."""
    generator = torch.Generator().manual_seed(seed)
    spread = torch.randn(count, generator=generator) * torch.logspace(-4, 3, count)
    return torch.cat([spread, torch.tensor(EDGES)])


def _write(x: torch.Tensor, scale: float, kv_cache_dtype: str, isa: str) -> torch.Tensor:
    """The value cache `[blocks, BLOCK * HEAD_DIM]` as path `isa`'s write leaves it, for `x` `[tokens, HEAD_DIM]`."""
    from vllm import _custom_ops as ops

    tokens = x.shape[0]
    blocks = -(-tokens // BLOCK)
    key_cache = torch.zeros(blocks, 1, BLOCK, HEAD_DIM, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    ops.cpu_attn_reshape_and_cache(x[:, None].clone(), x[:, None].clone(), key_cache, value_cache,
                                   torch.arange(tokens, dtype=torch.int64), isa, k_scale=scale, v_scale=scale,
                                   kv_cache_dtype=kv_cache_dtype)
    return value_cache.view(blocks, -1)


def layout(kv_cache_dtype: str, isa: str) -> torch.Tensor:
    """Per byte of a block of the value cache, the element (token * HEAD_DIM + dim) the write put there: `amx` packs
    a block for its tiles, `vec` keeps V row-major. Asked of the write itself: two writes of small exact codes, one
    holding each element's token + 1, the other its dim + 1, both stored as themselves at scale 1."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn if kv_cache_dtype == "fp8"
                                                      else torch.float8_e5m2).float()
    token, dim = torch.arange(BLOCK)[:, None].expand(BLOCK, HEAD_DIM), torch.arange(HEAD_DIM).expand(BLOCK, HEAD_DIM)
    stored_token = _write(codes[token + 1], 1.0, kv_cache_dtype, isa)[0].long() - 1
    stored_dim = _write(codes[dim + 1], 1.0, kv_cache_dtype, isa)[0].long() - 1
    place = stored_token * HEAD_DIM + stored_dim
    assert sorted(place.tolist()) == list(range(BLOCK * HEAD_DIM)), "the write's layout is not a permutation"
    return place


def vllm_bytes(x: torch.Tensor, scale: float, kv_cache_dtype: str, isa: str) -> torch.Tensor:
    """What vLLM's CPU kernel of path `isa` stores for `x` (flat) as values, with k_scale = v_scale = `scale`, in
    row-major order."""
    tokens = -(-x.numel() // HEAD_DIM)
    padded = torch.nn.functional.pad(x, (0, tokens * HEAD_DIM - x.numel())).view(tokens, HEAD_DIM)
    stored = _write(padded, scale, kv_cache_dtype, isa)
    ordered = torch.empty_like(stored)
    ordered[:, layout(kv_cache_dtype, isa)] = stored
    return ordered.reshape(-1)[: x.numel()]


def machine() -> dict[str, object]:
    """The CPU and the flags vLLM's CPU attention picks its path by."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    return {"cpu": model, "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}


def rows_for(isa: str, count: int) -> list[dict]:
    """Every case through the write of path `isa`, in this process: the bytes each engine model differs in."""
    from fp8kv.engine_models import engine_model
    from fp8kv.fp8 import FP8_DTYPES

    if isa == "amx":
        torch._C._cpu._init_amx()  # the tile permission vLLM's worker asks for before its AMX ops
    rows: list[dict] = []
    for kv_cache_dtype, kv in (("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
        for dtype in (torch.bfloat16, torch.float32):
            for scale in (1.0, 0.0123, 0.37, 3.5):
                x = values(count, seed=len(rows)).to(dtype)
                row = {"isa": isa, "cache": kv, "input": str(dtype).removeprefix("torch."), "scale": scale,
                       "values": x.numel()}
                try:
                    stored = vllm_bytes(x, scale, kv_cache_dtype, isa)
                except Exception as exc:  # what the op refuses is the finding, whatever it raises
                    rows.append(row | {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
                    continue
                s = torch.tensor(scale, dtype=torch.float32)
                for name in ("vllm-cpu", "vllm-cuda"):
                    model = engine_model(name).write(x.view(-1, 1), s, FP8_DTYPES[kv]).view(torch.uint8).view(-1)
                    row[f"{name} differs"] = int((model != stored).sum())
                rows.append(row)
    return rows


def run_isa(isa: str, count: int) -> tuple[list[dict], str | None]:
    """`rows_for(isa)` in a child process: its rows, or none and why the path could not run."""
    with tempfile.TemporaryDirectory(prefix="fp8kv-vllm-write-") as tmp:
        answer = Path(tmp) / "rows.json"
        done = subprocess.run([sys.executable, __file__, "--child", isa, "--count", str(count), "--out", str(answer)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(answer.read_text()), None
    died = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
    tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
    return [], f"{died}: {' | '.join(tail)}" if tail else died


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000, help="Random values per case (edge cases added).")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "bench" / "results" / "vllm_cpu_write.json")
    parser.add_argument("--child", choices=ISAS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.out.write_text(json.dumps(rows_for(args.child, args.count)))
        return

    import vllm

    rows, refused = [], {}
    for isa in ISAS:
        found, reason = run_isa(isa, args.count)
        rows += found
        if reason:
            refused[isa] = reason
    header = (f"{'isa':4} {'cache':9} {'input':9} {'scale':>7} {'values':>8} {'vllm-cpu differs':>17} "
              f"{'vllm-cuda differs':>18}")
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(header)
    for r in rows:
        differs = (f"{r['vllm-cpu differs']:>17} {r['vllm-cuda differs']:>18}" if "refused" not in r
                   else f"refused: {r['refused']}")
        print(f"{r['isa']:4} {r['cache']:9} {r['input']:9} {r['scale']:>7g} {r['values']:>8} {differs}")
    for isa, reason in refused.items():
        print(f"{isa}: cannot run here ({reason})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "machine": machine(),
                                    "rows": rows, "paths_not_run": refused}, indent=1) + "\n")
    if not any("refused" not in r for r in rows):
        raise SystemExit("no path of vLLM's CPU write ran here")
    if any(r.get("vllm-cpu differs") for r in rows):
        raise SystemExit("vllm-cpu's model differs from vLLM's CPU kernel")


if __name__ == "__main__":
    main()
