"""The torch ragged paged attention against torch_xla's reference (XLA:CPU) and a dense per-sequence loop."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.runtime.attention import ragged_paged_attention  # noqa: E402

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 4, 18
KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 32


def _ragged_batch(dtype: torch.dtype, seed: int = 0, q_lens=(6, 1, 3), kv_lens=(6, 11, 9)):
    """Three live sequences in four slots, by default a prefill spanning pages, a decode, a chunk after context."""
    g = torch.Generator().manual_seed(seed)
    kv_pages = (torch.randn(NUM_PAGES, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM, generator=g) * 3).to(dtype)
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    tokens = sum(q_lens) + 2  # 2 padding rows
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g)
    page_indices = torch.randperm(NUM_PAGES - 1, generator=g)[: 4 * PAGES_PER_SEQ].add(1).reshape(4, PAGES_PER_SEQ)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta = dict(
        kv_lens=torch.tensor(kv_lens + [0], dtype=torch.int32),
        page_indices=page_indices.int(),
        cu_q_lens=torch.tensor(cu + [cu[-1]], dtype=torch.int32),
        num_seqs=torch.tensor([3], dtype=torch.int32),
    )
    return q, kv_pages, meta, cu[-1]


def _dense(q, kv_pages, meta, k_scale, v_scale, sm_scale, window, cap):
    """One sequence at a time with explicit masks: the definition the fast paths must meet."""
    outs = []
    group = Q_HEADS // KV_HEADS
    for s in range(int(meta["num_seqs"][0])):
        start, end = int(meta["cu_q_lens"][s]), int(meta["cu_q_lens"][s + 1])
        kv_len = int(meta["kv_lens"][s])
        pages = kv_pages.view(torch.uint8)[meta["page_indices"][s].long()].view(kv_pages.dtype)
        pages = pages.flatten(0, 1)[:kv_len].float()
        k = pages[:, 0::2].repeat_interleave(group, 1) * k_scale
        v = pages[:, 1::2].repeat_interleave(group, 1) * v_scale
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * sm_scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        pos = torch.arange(kv_len - (end - start), kv_len)[:, None]
        key = torch.arange(kv_len)[None]
        allowed = (key <= pos) & ((key > pos - window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


CASES = [
    (torch.float8_e4m3fn, 0.5, 2.0, None, None),
    (torch.float8_e5m2, 0.25, 0.75, 4, 30.0),
    (torch.bfloat16, 1.5, 0.5, None, 20.0),
    (torch.bfloat16, 0.8, 1.2, 3, None),
]


@pytest.mark.parametrize("dtype,k_scale,v_scale,window,cap", CASES)
def test_torch_attention_matches_torch_xla_reference(dtype, k_scale, v_scale, window, cap):
    import torch_xla

    q, kv_pages, meta, real = _ragged_batch(dtype)
    kwargs = dict(sm_scale=0.3, k_scale=k_scale, v_scale=v_scale, sliding_window=window, soft_cap=cap)
    ours = ragged_paged_attention(q, kv_pages, **meta, **kwargs, backend="torch")
    dev = torch_xla.device()
    with torch.no_grad():
        xla_meta = {k: v.to(dev) for k, v in meta.items()}
        ref = ragged_paged_attention(q.to(dev), kv_pages.to(dev), **xla_meta, **kwargs, backend="xla").cpu()
        ours_on_xla = ragged_paged_attention(q.to(dev), kv_pages.to(dev), **xla_meta, **kwargs, backend="torch").cpu()
    assert ours.shape == ref.shape == q.shape
    torch.testing.assert_close(ours[:real], ref[:real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_on_xla, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[:real], _dense(q, kv_pages, meta, k_scale, v_scale, 0.3, window, cap),
                               rtol=1e-4, atol=1e-4)
    assert (ours[real:] == 0).all() and (ref[real:] == 0).all()


def test_per_head_scales_scale_each_kv_head():
    q, kv_pages, meta, real = _ragged_batch(torch.float8_e4m3fn, seed=1)
    k_heads, v_heads = torch.tensor([0.5, 0.5]), torch.tensor([2.0, 2.0])
    per_head = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=k_heads, v_scale=v_heads)
    scalar = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(per_head, scalar)
    uneven = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=torch.tensor([0.5, 1.0]), v_scale=v_heads)
    group = Q_HEADS // KV_HEADS
    torch.testing.assert_close(uneven[:, :group], scalar[:, :group])  # kv head 0 unchanged
    assert not torch.allclose(uneven[:real, group:], scalar[:real, group:])


def test_nan_in_a_stale_slot_past_kv_len_does_not_leak():
    q, kv_pages, meta, real = _ragged_batch(torch.float8_e4m3fn, seed=2)
    clean = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=1.0, v_scale=1.0)
    last_page = meta["page_indices"][1, 2]  # sequence 1 holds 11 tokens: slot 3 of its third page is stale
    kv_pages[last_page, 3] = float("nan")
    dirty = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(dirty, clean)
    kv_pages[last_page, 2, 1] = float("nan")  # a live V value of kv head 0: its query heads turn NaN
    poisoned = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=1.0, v_scale=1.0)
    assert poisoned[6, :2].isnan().all() and not poisoned[6, 2:].isnan().any()



@pytest.mark.parametrize("dtype,k_scale,v_scale", [(torch.float8_e4m3fn, 0.5, 2.0), (torch.bfloat16, 1.0, 1.0)])
def test_a_step_of_whole_prompts_matches_the_dense_definition(dtype, k_scale, v_scale):
    q, kv_pages, meta, real = _ragged_batch(dtype, seed=4, q_lens=(6, 3, 9), kv_lens=(6, 3, 9))
    out = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out[:real], _dense(q, kv_pages, meta, k_scale, v_scale, 0.3, None, None),
                               rtol=1e-4, atol=1e-4)
    assert (out[real:] == 0).all()


@pytest.mark.parametrize("window", [9, 512])
def test_a_window_as_long_as_every_prompt_changes_nothing(window):
    """Gemma's sliding layers over prompts no longer than the window: the same outputs as without one, and the dense
    definition's. One key shorter, it hides the longest prompt's first key from its last query."""
    q, kv_pages, meta, real = _ragged_batch(torch.float8_e4m3fn, seed=5, q_lens=(6, 3, 9), kv_lens=(6, 3, 9))
    scales = dict(sm_scale=0.3, k_scale=0.5, v_scale=2.0)
    out = ragged_paged_attention(q, kv_pages, **meta, **scales, sliding_window=window)
    assert torch.equal(out, ragged_paged_attention(q, kv_pages, **meta, **scales))
    torch.testing.assert_close(out[:real], _dense(q, kv_pages, meta, 0.5, 2.0, 0.3, window, None), rtol=1e-4, atol=1e-4)
    shorter = ragged_paged_attention(q, kv_pages, **meta, **scales, sliding_window=8)
    torch.testing.assert_close(shorter[:real], _dense(q, kv_pages, meta, 0.5, 2.0, 0.3, 8, None), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(shorter[real - 1], out[real - 1], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("lens", [((6, 1, 3), (6, 11, 9)), ((6, 3, 9), (6, 3, 9))], ids=["mixed", "whole-prompts"])
def test_a_nan_key_reaches_only_the_queries_at_or_after_it(lens):
    """A NaN written by a non-clamping engine poisons exactly the rows causal attention lets see it: the logit
    rows verify counts as lost."""
    q, kv_pages, meta, real = _ragged_batch(torch.bfloat16, 3, *lens)
    first_page = meta["page_indices"][0, 0]  # sequence 0 prefills 6 tokens: rows 0..5
    kv_pages[first_page, 3, 0] = float("nan")  # K of KV head 0 at position 3
    out = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.3, k_scale=1.0, v_scale=1.0)
    group = Q_HEADS // KV_HEADS
    assert not out[:3, :group].isnan().any() and out[3:6, :group].isnan().all()
    assert out[:6, group:].isfinite().all()  # KV head 1's query heads never read it
    assert out[6:real].isfinite().all()  # nor do the other sequences

def test_unknown_backend_is_refused():
    q, kv_pages, meta, _ = _ragged_batch(torch.bfloat16)
    with pytest.raises(Fp8kvError, match="unknown attention backend 'cuda'"):
        ragged_paged_attention(q, kv_pages, **meta, backend="cuda")


def _tpu_scale_batch():
    """bf16 queries over an fp8 cache whose dequantized outputs reach tens, where bf16's step is 0.125 to 0.5."""
    q, kv_pages, meta, real = _ragged_batch(torch.float32, seed=3)
    kv_pages = (kv_pages * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q * 2).to(torch.bfloat16), kv_pages, meta, real


def test_xla_reference_numerics_reproduce_torch_xla_far_closer_than_float32():
    """torch_xla's reference rounds K/V, scores and probabilities to bf16: the float32 path misses by several bf16
    steps, the rounding reproduced by at most one step, and on most outputs not at all."""
    import torch_xla

    q, kv_pages, meta, real = _tpu_scale_batch()
    kwargs = dict(sm_scale=HEAD_DIM ** -0.5, k_scale=0.05, v_scale=0.2)
    dev = torch_xla.device()
    with torch.no_grad():
        xla_meta = {k: v.to(dev) for k, v in meta.items()}
        ref = ragged_paged_attention(q.to(dev), kv_pages.to(dev), **xla_meta, **kwargs, backend="xla").cpu()[:real]
    gaps = {numerics: (ragged_paged_attention(q, kv_pages, **meta, **kwargs, numerics=numerics)[:real].float()
                       - ref.float()).abs() for numerics in ("float32", "xla-reference")}
    step = 2.0 ** (torch.frexp(ref.float().abs().max()).exponent.item() - 8)  # bf16's step at the largest output
    assert ref.float().abs().max() > 16
    # measured: float32 misses by up to 1.31 (2.6 steps of 0.5), mean 0.060, 67% exact; the reproduced rounding
    # by up to 0.125, mean 0.0008, 98% exact (what remains: the order XLA sums the softmax in)
    assert gaps["float32"].max() >= 2 * step and gaps["xla-reference"].max() <= step / 2
    assert gaps["xla-reference"].mean() * 20 < gaps["float32"].mean()
    assert (gaps["xla-reference"] == 0).float().mean() > 0.95 > 0.8 > (gaps["float32"] == 0).float().mean()


def test_pallas_kernel_numerics_scale_after_qk_and_pv():
    """The v2 kernel multiplies raw fp8 K and V and applies (sm_scale * k_scale) to QK, v_scale to PV, in float32."""
    q, kv_pages, meta, real = _tpu_scale_batch()
    q = q.float()
    k_scale, v_scale = torch.tensor([0.05, 0.07]), torch.tensor([0.2, 0.3])
    kernel = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.1, k_scale=k_scale, v_scale=v_scale,
                                    numerics="pallas-kernel")[:real]
    group = Q_HEADS // KV_HEADS
    outs = []
    for s in range(int(meta["num_seqs"][0])):
        start, end, kv_len = int(meta["cu_q_lens"][s]), int(meta["cu_q_lens"][s + 1]), int(meta["kv_lens"][s])
        pages = kv_pages.view(torch.uint8)[meta["page_indices"][s].long()].view(kv_pages.dtype)
        pages = pages.flatten(0, 1)[:kv_len].float()
        k, v = pages[:, 0::2].repeat_interleave(group, 1), pages[:, 1::2].repeat_interleave(group, 1)
        qk = torch.einsum("qhd,khd->hqk", q[start:end], k) * (0.1 * k_scale.repeat_interleave(group))[:, None, None]
        qk = qk.masked_fill(torch.arange(kv_len)[None] > torch.arange(kv_len - (end - start), kv_len)[:, None], -torch.inf)
        outs.append(torch.einsum("hqk,khd->qhd", qk.softmax(-1), v) * v_scale.repeat_interleave(group)[:, None])
    torch.testing.assert_close(kernel, torch.cat(outs), rtol=1e-6, atol=1e-5)
    float32 = ragged_paged_attention(q, kv_pages, **meta, sm_scale=0.1, k_scale=k_scale, v_scale=v_scale)[:real]
    torch.testing.assert_close(kernel, float32, rtol=1e-5, atol=1e-4)  # the same sums, in another order


def test_unknown_numerics_are_refused():
    q, kv_pages, meta, _ = _ragged_batch(torch.bfloat16)
    with pytest.raises(Fp8kvError, match="unknown attention numerics 'bf16'; choose one of float32, xla-reference"):
        ragged_paged_attention(q, kv_pages, **meta, numerics="bf16")


def _one_sequence(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> dict:
    """One query over len(keys) cached tokens of one KV head of width HEAD_DIM (a one-page sequence)."""
    kv_pages = torch.zeros(2, PAGE_SIZE, 2, HEAD_DIM)
    kv_pages[1, : len(keys), 0], kv_pages[1, : len(keys), 1] = keys, values
    return dict(q=query.reshape(1, 1, HEAD_DIM).to(torch.bfloat16), kv_pages=kv_pages.to(torch.float8_e4m3fn),
                kv_lens=torch.tensor([len(keys)], dtype=torch.int32), page_indices=torch.tensor([[1]], dtype=torch.int32),
                cu_q_lens=torch.tensor([0, 1], dtype=torch.int32), num_seqs=torch.tensor([1], dtype=torch.int32))


def test_vllm_cpu_amx_numerics_read_e4m3_subnormals_as_zero_and_normals_exactly():
    """One cached token reads V back (its weight is 1): on vLLM CPU's amx path every e4m3 subnormal code reads as
    0 and every normal one exactly; the float32 path reads both."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)]
    for start in range(0, len(finite), HEAD_DIM):
        value = torch.zeros(HEAD_DIM)
        chunk = finite[start : start + HEAD_DIM]
        value[: len(chunk)] = chunk
        batch = _one_sequence(torch.zeros(1, HEAD_DIM), value[None], torch.ones(HEAD_DIM))
        amx = ragged_paged_attention(**batch, k_scale=1.0, v_scale=0.5, numerics="vllm-cpu-amx")[0, 0].float()
        exact = ragged_paged_attention(**batch, k_scale=1.0, v_scale=0.5)[0, 0].float()
        expected = torch.where(value.abs() < 2.0**-6, 0.0, value) * 0.5
        assert torch.equal(amx, expected.to(torch.bfloat16).float())
        assert torch.equal(exact, (value * 0.5).to(torch.bfloat16).float())


@pytest.mark.parametrize("large, small, kept", [(0, 2, True), (0, 1, False), (2, 0, False), (1, 31, True)])
def test_vllm_cpu_amx_numerics_keep_a_small_product_only_after_a_large_one_in_its_chain(large, small, kept):
    """An AMX tile instruction sums its 32 terms as two chains, the even-indexed and the odd-indexed ones, and
    flushes every partial sum below 2^-6: in q·k = 1 x 1 + 2^-7 x 1 the small term counts only when it comes after
    the large one in the same chain (vLLM CPU's amx path, probed: kept exactly when both have the parity and the
    small one is later). Both tokens share the large term, so the small one alone decides token 1's softmax
    weight, which V reads out."""
    keys = torch.zeros(2, HEAD_DIM)
    keys[:, large], keys[1, small] = 1.0, 1.0
    values = torch.zeros(2, HEAD_DIM)
    values[1, 1] = 1.0
    query = torch.zeros(HEAD_DIM)
    query[large], query[small] = 1.0, 2.0**-7
    k_scale = 128.0  # the small term moves token 1's score by 1
    out = ragged_paged_attention(**_one_sequence(keys, values, query), k_scale=k_scale, v_scale=1.0,
                                 numerics="vllm-cpu-amx")[0, 0, 1]
    expected = torch.softmax(torch.tensor([k_scale, k_scale + (2.0**-7 * k_scale if kept else 0.0)]), 0)[1]
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("k8", [0.5, 2.0, 256.0])
def test_vllm_cpu_amx_numerics_lose_a_query_key_product_below_two_to_the_minus_6(k8):
    """Two cached tokens, K read through the softmax weight of a one-hot query: the product q * k8 counts from
    exactly 2^-6 and is lost below it, whatever the scale; V tells the two tokens apart."""
    keys = torch.zeros(2, HEAD_DIM)
    keys[1, 0] = k8
    values = torch.zeros(2, HEAD_DIM)
    values[1, 1] = 1.0
    for q0, kept in ((2.0**-6 / k8, True), (2.0**-6 / k8 * (1 - 2.0**-8), False)):  # the next bf16 below
        query = torch.zeros(HEAD_DIM)
        query[0] = q0
        batch = _one_sequence(keys, values, query)
        assert float(batch["q"][0, 0, 0]) == q0  # held exactly in bf16
        k_scale = 4096.0  # a score large enough that whether q * k8 counts moves the softmax
        out = ragged_paged_attention(**batch, k_scale=k_scale, v_scale=1.0, numerics="vllm-cpu-amx")[0, 0, 1]
        expected = torch.softmax(torch.tensor([0.0, q0 * k8 * k_scale if kept else 0.0]), 0)[1]
        torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0)
