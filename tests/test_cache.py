"""The paged cache: quantized writes, overflow counters, page allocation and prefix sharing."""

from __future__ import annotations

import math

import pytest
import torch

from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import cache_dtype, quantize
from fp8kv.runtime.cache import SCRATCH_PAGE, PageAllocator, PagedKVCache


def _cache(dtype="fp8_e4m3", engine="vllm-tpu", k_scales=None, v_scales=None, multiple=1, shadows=()):
    return PagedKVCache(
        [0, 2], num_pages=6, page_size=4, num_kv_heads=2, head_dim=3, dtype=cache_dtype(dtype),
        device=torch.device("cpu"), head_dim_multiple=multiple, k_scales=k_scales, v_scales=v_scales,
        engine=engine, shadows=shadows,
    )


def test_fp8_writes_saturate_at_max():
    x = torch.tensor([1.0, 448.0, 464.0, 465.0, 1e6, -1e6, float("inf")])
    e4m3 = quantize(x, torch.tensor(1.0), torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [1.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0]
    e5m2 = quantize(x * 100, torch.tensor(1.0), torch.float8_e5m2).float()
    assert e5m2[-3:].tolist() == [57344.0, -57344.0, 57344.0]


def test_scale_divides_before_the_cast():
    stored = quantize(torch.tensor([0.5, 4.0]), torch.tensor(0.01), torch.float8_e4m3fn)  # 50 -> 48 (e4m3 grid)
    assert stored.float().tolist() == [48.0, 384.0]  # 400 rounds to 384
    assert quantize(torch.tensor([3.0]), torch.tensor(0.01), torch.bfloat16).float().item() == 3.0  # no scale


def _write(cache, layer, k, v, slots, valid=None):
    valid = torch.ones(len(slots), dtype=torch.bool) if valid is None else valid
    cache.write(layer, k, v, torch.tensor(slots), valid)


def test_write_interleaves_k_and_v_and_pads_head_dim():
    cache = _cache("fp32", multiple=8)
    k = torch.arange(1.0, 7.0).reshape(1, 2, 3)
    v = -k
    _write(cache, 2, k, v, [9])  # page 2, offset 1
    page = cache.layer_pages(2)
    assert page.shape == (6, 4, 4, 8)
    assert page[2, 1, :, :3].tolist() == [k[0, 0].tolist(), v[0, 0].tolist(), k[0, 1].tolist(), v[0, 1].tolist()]
    assert (page[2, 1, :, 3:] == 0).all()
    assert page.count_nonzero() == 12 and cache.layer_pages(0).count_nonzero() == 0


def test_counts_clamped_and_nonfinite_per_layer_and_k_v():
    k = torch.full((2, 2, 3), 10.0)
    v = torch.full((2, 2, 3), 1.0)
    k[0, 1, 0] = 500.0  # over MAX at scale 1 -> clamped
    saturating = _cache(k_scales={0: 1.0, 2: 1.0}, v_scales={0: 0.001, 2: 1.0})  # v / 0.001 = 1000 > 448
    _write(saturating, 0, k, v, [4, 5])
    counts = saturating.counts()
    assert counts.clamped == {0: (1, 12), 2: (0, 0)}
    assert counts.nonfinite == {0: (0, 0), 2: (0, 0)}
    assert counts.written[0] == 12
    raw = _cache(engine="no-clamp", k_scales={0: 1.0, 2: 1.0}, v_scales={0: 0.001, 2: 1.0})
    _write(raw, 0, k, v, [4, 5])
    assert raw.counts().nonfinite == {0: (1, 12), 2: (0, 0)}
    assert raw.layer_pages(0).float().isnan().sum() == 13


def test_padding_tokens_are_not_counted():
    cache = _cache()
    k = torch.full((2, 2, 3), 1000.0)
    _write(cache, 0, k, k, [4, SCRATCH_PAGE], valid=torch.tensor([True, False]))
    assert cache.counts().clamped[0] == (6, 6)



def test_amax_is_the_largest_magnitude_per_layer_kv_and_head_of_real_tokens():
    cache = _cache("bf16")
    k = torch.tensor([[[1.0, -3.0, 2.0], [0.5, 0.0, -0.25]], [[-7.0, 1.0, 1.0], [9.0, 9.0, 9.0]]])
    v = torch.tensor([[[-4.0, 0.0, 0.0], [1.0, 2.0, 6.0]], [[1e6, 1e6, 1e6], [1e6, 1e6, 1e6]]])
    _write(cache, 2, k, v, [4, SCRATCH_PAGE], valid=torch.tensor([True, False]))  # the padding token's 1e6 is not seen
    _write(cache, 2, -k[1:] / 2, v[:1], [5])
    amax = cache.counts().amax
    assert amax[2] == ((3.5, 4.5), (4.0, 6.0)) and amax[0] == ((0.0, 0.0), (0.0, 0.0))
    k[0, 0, 0] = float("nan")
    _write(cache, 0, k[:1], v[:1], [6])
    assert math.isnan(cache.counts().amax[0][0][0]) and cache.counts().amax[0][1] == (4.0, 6.0)

def test_per_head_scales_apply_to_their_head():
    cache = _cache(k_scales={0: [1.0, 0.5], 2: 1.0}, v_scales={0: 2.0, 2: 1.0})
    ones = torch.ones(1, 2, 3)
    _write(cache, 0, ones, ones, [4])
    stored = cache.layer_pages(0)[1, 0].float()[:, 0]  # combined heads K0, V0, K1, V1
    assert stored.tolist() == [1.0, 0.5, 2.0, 0.5]


def test_layers_differ_in_kv_heads_and_head_dim():
    # a Gemma 4 shape: sliding layer 0 with 2 heads of 3, global layer 2 with 1 head of 5 (padded to 8)
    cache = PagedKVCache([0, 2], num_pages=6, page_size=4, num_kv_heads=[2, 1], head_dim=[3, 5],
                         dtype=cache_dtype("fp8_e4m3"), device=torch.device("cpu"), head_dim_multiple=4,
                         k_scales={0: [1.0, 0.5], 2: [0.25]}, v_scales={0: 2.0, 2: 4.0})
    assert [tuple(cache.layer_pages(layer).shape) for layer in (0, 2)] == [(6, 4, 4, 4), (6, 4, 2, 8)]
    assert (cache.num_kv_heads, cache.head_dim, cache.head_dim_padded) == (2, 5, 8)
    assert [(cache.layer_kv_heads(layer), cache.layer_head_dim(layer)) for layer in (0, 2)] == [(2, 3), (1, 5)]
    _write(cache, 2, torch.full((1, 1, 5), 1000.0), torch.ones(1, 1, 5), [4])
    assert cache.layer_pages(2)[1, 0].float()[:, :6].tolist() == [[448.0] * 5 + [0.0], [0.25] * 5 + [0.0]]
    assert cache.counts().clamped[2] == (5, 0) and cache.counts().written[2] == 5
    assert cache.scale_args(2) == (0.25, 4.0)
    assert cache.scale_args(0)[0].tolist() == [1.0, 0.5]  # per head: the layer's own head count, not the widest
    assert cache.bytes_per_token() == 4 * 4 + 2 * 8


def test_bytes_per_token_fp8_is_half_of_bf16():
    assert _cache("fp8_e4m3").bytes_per_token() * 2 == _cache("bf16").bytes_per_token() == 2 * 2 * 2 * 3 * 2


@pytest.mark.parametrize(
    "k_scales,message",
    [
        ({0: 1.0}, r"k_scale: layers missing \[2\], unexpected \[\]"),
        ({0: 1.0, 1: 1.0, 2: 1.0}, r"k_scale: layers missing \[\], unexpected \[1\]"),
        ({0: 0.0, 2: 1.0}, r"k_scale of layer 0: \[0.0\] must be finite and > 0"),
        ({0: [1.0, 1.0, 1.0], 2: 1.0}, r"k_scale of layer 0: 3 values; give 1 or 2"),
    ],
)
def test_bad_scales_are_refused(k_scales, message):
    with pytest.raises(Fp8kvError, match=message):
        _cache(k_scales=k_scales)


def test_unknown_dtype_is_refused():
    with pytest.raises(Fp8kvError, match="unknown KV-cache dtype 'fp16'; choose one of fp8_e4m3, fp8_e5m2, bf16, fp32, fp8$"):
        cache_dtype("fp16")
    assert cache_dtype("fp8") is torch.float8_e4m3fn  # vLLM's spelling


def test_allocator_slots_span_pages_and_prefix_pages_are_shared():
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.add(0)
    slots = alloc.extend(0, 6)
    pages = alloc.tables[0]
    assert len(pages) == 2 and SCRATCH_PAGE not in pages
    assert slots == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4, pages[1] * 4 + 1]
    assert alloc.add(1, share_from=0, shared_tokens=5) == 4  # only whole pages are shared
    assert alloc.tables[1] == pages[:1]
    new = alloc.extend(1, 3)
    assert new[0] // 4 not in pages  # the sharer writes into its own page
    free_before = alloc.free_pages
    alloc.free(0)
    assert alloc.free_pages == free_before + 1  # the shared page stays with sequence 1
    alloc.free(1)
    assert alloc.free_pages == 7


def test_allocator_reports_a_full_cache():
    alloc = PageAllocator(num_pages=3, page_size=2)
    alloc.add(0)
    with pytest.raises(Fp8kvError, match="the KV cache is full"):
        alloc.extend(0, 5)


def test_shadow_engines_count_the_values_they_would_store_differently():
    k = torch.full((2, 2, 3), 10.0)
    v = torch.full((2, 2, 3), 1.0)
    k[0, 1, 0] = 500.0  # past 464 at scale 1: NaN without a clamp, 448 with one
    k[1, 0, 2] = 450.0  # past 448 but not 464: 448 either way
    cache = _cache(k_scales={0: 1.0, 2: 1.0}, v_scales={0: 1.0, 2: 1.0}, shadows=("no-clamp", "vllm-cuda"))
    counts = cache.start_forward(2)
    _write(cache, 0, k, v, [4, 5])
    _write(cache, 2, k, v, [4, 5])
    assert counts.shadow_diffs.tolist() == [[2, 0], [0, 0]]  # per shadow engine and token, over both layers
    assert counts.over.tolist() == [2, 2]  # past 448: token 0's 500 and token 1's 450, in each layer
    with pytest.raises(Fp8kvError, match="engine kv-swapped runs other scales or another cache format than vllm-tpu"):
        _cache(shadows=("kv-swapped",))
