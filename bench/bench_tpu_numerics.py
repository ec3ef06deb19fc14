"""How far each attention arithmetic of the torch backend lands from torch_xla's reference (XLA:CPU).

bf16 queries over an fp8 e4m3 cache (8B-shaped heads: 32 query heads, 8 KV heads, head_dim 128), one
prefill chunk and one decode per case, random K/V spread over the fp8 range. For each `numerics`
(`runtime.attention.AttentionNumerics`): the largest and mean |output - reference| and the share of
outputs equal to it bit for bit. Prints a table, writes bench/results/tpu_numerics.json.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_tpu_numerics.py [--kv-lens 64 512 2048]
"""

from __future__ import annotations

import argparse
import os

import torch

import common  # bench/common.py

os.environ.setdefault("PJRT_DEVICE", "CPU")

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
NUMERICS = ("float32", "xla-reference", "pallas-kernel")


def case(kv_len: int, v_scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A prefill chunk of 8 tokens after kv_len - 8 cached ones, and a decode of a second sequence of kv_len."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-kv_len // PAGE_SIZE)
    kv = (torch.randn(2 * pages_per_seq + 1, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM, generator=g) * 100).clamp(-448, 448)
    q = (torch.randn(9, Q_HEADS, HEAD_DIM, generator=g) * 2).to(torch.bfloat16)
    meta = dict(kv_lens=torch.tensor([kv_len, kv_len], dtype=torch.int32),
                page_indices=torch.arange(1, 2 * pages_per_seq + 1, dtype=torch.int32).view(2, pages_per_seq),
                cu_q_lens=torch.tensor([0, 8, 9], dtype=torch.int32), num_seqs=torch.tensor([2], dtype=torch.int32))
    return q, kv.to(torch.float8_e4m3fn), meta


def measure(kv_len: int, v_scale: float, seed: int) -> list[dict]:
    import torch_xla

    from fp8kv.runtime.attention import ragged_paged_attention

    q, kv, meta = case(kv_len, v_scale, seed)
    kwargs = dict(sm_scale=HEAD_DIM ** -0.5, k_scale=0.02, v_scale=v_scale)
    dev = torch_xla.device()
    with torch.no_grad():
        reference = ragged_paged_attention(q.to(dev), kv.to(dev), **{k: v.to(dev) for k, v in meta.items()},
                                           **kwargs, backend="xla").cpu().float()
    rows = []
    for numerics in NUMERICS:
        out = ragged_paged_attention(q, kv, **meta, **kwargs, backend="torch", numerics=numerics).float()
        gap = (out - reference).abs()
        rows.append({"kv_len": kv_len, "v_scale": v_scale, "max_abs_out": float(reference.abs().max()),
                     "numerics": numerics, "max_gap": float(gap.max()), "mean_gap": float(gap.mean()),
                     "exact": float((gap == 0).float().mean())})
    return rows


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--kv-lens", type=int, nargs="+", default=[64, 512, 2048])
    options.add_argument("--v-scales", type=float, nargs="+", default=[0.05, 0.2])
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--device", default="xla-cpu")
    args = options.parse_args()
    rows = [row for kv_len in args.kv_lens for v_scale in args.v_scales for row in measure(kv_len, v_scale, args.seed)]
    print("| kv_len | v_scale | max abs output | numerics | max gap | mean gap | exact |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['kv_len']} | {r['v_scale']:g} | {r['max_abs_out']:.4g} | {r['numerics']} | {r['max_gap']:.4g} "
              f"| {r['mean_gap']:.3g} | {r['exact']:.1%} |")
    common.write_results("tpu_numerics", rows, args)


if __name__ == "__main__":
    main()
