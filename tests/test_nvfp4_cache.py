"""The NVFP4 paged cache: what it stores, what attention reads back, its counters, and the runner on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.fp8 import to_float32, to_fp8  # noqa: E402
from fp8kv.nvfp4 import E4M3, Nvfp4Tensor, block_values, dequantize, quantize  # noqa: E402
from fp8kv.runtime.cache import PagedKVCache  # noqa: E402
from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402
from fp8kv.tools.factory import make_checkpoint  # noqa: E402

CPU = torch.device("cpu")
K_SCALES, V_SCALES = {0: 0.01, 3: [0.02, 0.005]}, {0: 0.03, 3: 0.004}


def _cache(read="float32", four_over_six=False, multiple=1, fp8_keys=False):
    return Nvfp4PagedKVCache([0, 3], num_pages=4, page_size=4, num_kv_heads=2, head_dim=32, device=CPU, read=read,
                             four_over_six=four_over_six, k_scales=K_SCALES, v_scales=V_SCALES,
                             head_dim_multiple=multiple, fp8_keys=fp8_keys)


def _kv(tokens=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, 2, 32, generator=generator).to(torch.bfloat16) for _ in range(2)]


@pytest.mark.parametrize("four_over_six", [False, True])
def test_a_write_stores_the_codes_and_block_scales_quantize_gives_at_its_slots(four_over_six):
    cache, (k, v) = _cache(four_over_six=four_over_six), _kv()
    slots = torch.tensor([5, 6, 9])
    cache.write(3, k, v, slots, torch.ones(3, dtype=torch.bool))
    for side, (x, scale) in enumerate(((k, torch.tensor([[0.02], [0.005]])), (v, torch.tensor(0.004)))):
        stored, _ = quantize(x, scale, four_over_six=four_over_six)
        codes = cache.codes[1].flatten(0, 1)[slots][:, side::2]  # heads interleaved K0, V0, K1, V1
        scales = cache.block_scales[1].flatten(0, 1)[slots][:, side::2]
        assert torch.equal(codes, stored.codes) and torch.equal(scales, stored.block_scales.view(torch.uint8))
        pages = cache.pages[1].flatten(0, 1)[slots][:, side::2]
        assert torch.equal(pages, dequantize(stored))  # the float32 read is the read-back of those bytes
    assert cache.scale_args(3) == (None, None)  # already applied


@pytest.mark.parametrize("read", ["float32", "fp8"])
def test_fp8_keys_store_the_fp8_caches_k_bytes_and_v_as_nvfp4(read):
    """fp8_k_nvfp4_v: K's bytes are the fp8 e4m3 cache's write (the default engine's: float32 division, clamped at
    448), read as that cache reads them; V's codes and block scales are the nvfp4 write's; K counts clamps, not
    NVFP4 counters."""
    cache, (k, v) = _cache(read=read, fp8_keys=True), _kv()
    k[0, 1, :4] = 0.005 * 500  # past 448 x its k_scale: clamped (and any other past it)
    slots, k_scale = torch.tensor([5, 6, 9]), torch.tensor([[0.02], [0.005]])
    cache.write(3, k, v, slots, torch.ones(3, dtype=torch.bool))
    fp8 = PagedKVCache([3], num_pages=4, page_size=4, num_kv_heads=2, head_dim=32, dtype=E4M3, device=CPU,
                       k_scales={3: K_SCALES[3]}, v_scales={3: 1.0})
    fp8.write(3, k, v, slots, torch.ones(3, dtype=torch.bool))
    fp8_k = fp8.pages[0].view(torch.uint8).flatten(0, 1)[slots][:, 0::2]  # CPU torch indexes fp8 as bytes only
    assert torch.equal(cache.keys[1].flatten(0, 1)[slots], fp8_k)
    stored, _ = quantize(v, torch.tensor(0.004))
    assert torch.equal(cache.codes[1].flatten(0, 1)[slots], stored.codes)  # V alone: [slots, kv_heads, 16]
    assert torch.equal(cache.block_scales[1].flatten(0, 1)[slots], stored.block_scales.view(torch.uint8))
    if read == "float32":
        pages = cache.pages[1].flatten(0, 1)[slots]
        assert torch.equal(pages[:, 0::2], to_float32(fp8_k.view(E4M3)) * k_scale)
        assert cache.scale_args(3) == (None, None)
    else:
        assert torch.equal(cache.pages[1].view(torch.uint8).flatten(0, 1)[slots][:, 0::2], fp8_k)
        assert cache.scale_args(3)[1] == pytest.approx(0.004)
    clamped = cache.counts().clamped[3]
    assert clamped == (fp8.counts().clamped[3][0], 0) and clamped[0] >= 4
    assert all(k == 0 for k, _ in cache.nvfp4_counts().clipped_values.values())
    assert cache.bytes_per_token() == 2 * 2 * (32 + 16 + 2)  # 2 layers x 2 heads: fp8 K, V's codes and scales
    with pytest.raises(Fp8kvError, match="this cache holds an fp8 K"):
        cache.vllm_page(3, 1, swizzle_v=False)


def test_the_fp8_read_holds_e2m1_times_block_scale_in_e4m3_and_leaves_the_global_scale_to_attention():
    cache, (k, v) = _cache(read="fp8", multiple=128), _kv()
    cache.write(0, k, v, torch.tensor([4, 5, 6]), torch.ones(3, dtype=torch.bool))
    stored, _ = quantize(k, 0.01)
    pages = cache.pages[0].flatten(0, 1)[4:7]  # [3, 4, 128]: padded to the head_dim multiple with zeros
    assert pages.dtype == E4M3 and pages.shape == (3, 4, 128)
    expected = to_fp8(block_values(stored), E4M3, saturate=True)
    assert torch.equal(pages[:, 0::2, :32].view(torch.uint8), expected.view(torch.uint8))
    assert not pages[..., 32:].float().any()
    k_scale, v_scale = cache.scale_args(0)
    assert (k_scale, v_scale) == (pytest.approx(0.01), pytest.approx(0.03))


def test_counters_per_layer_and_side_and_padding_tokens_count_nothing():
    cache = _cache(read="fp8")
    k = torch.full((2, 2, 32), 0.01 * 6 * 448 * 2)  # bmax / 6 / s = 896: saturated, every value clipped at 6
    v = torch.full((2, 2, 32), 1e-9)  # bmax / 6 / s below e4m3's smallest subnormal: zeroed
    cache.write(0, k, v, torch.tensor([4, 0]), torch.tensor([True, False]))
    counts = cache.nvfp4_counts()
    assert counts.saturated_scales == {0: (4, 0), 3: (0, 0)}  # 2 heads x 2 blocks of the one real token
    assert counts.zeroed_blocks == {0: (0, 4), 3: (0, 0)}
    assert counts.clipped_values == {0: (64, 0), 3: (0, 0)}
    assert counts.fp8_read_over == {0: (64, 0), 3: (0, 0)}  # 6 times a block scale of 448: 2688, past e4m3
    assert cache.counts().written == {0: 64, 3: 0}
    assert cache.counts().clamped == {0: (0, 0), 3: (0, 0)}  # the fp8 counter does not apply


def test_a_block_scale_above_448_over_6_is_counted_as_past_the_fp8_read():
    """s = amax / 2688 (ModelOpt's scale before it moved to amax / 448): a block max stored as e2m1 6 times a block
    scale of 448 reads as 2688 in an fp8 attention, past e4m3's 448."""
    cache, amax = _cache(read="fp8"), 2688 * 0.01
    k = torch.linspace(-amax, amax, 32).expand(1, 2, 32)
    cache.write(0, k, k / 3, torch.tensor([4]), torch.ones(1, dtype=torch.bool))
    over_k, over_v = cache.nvfp4_counts().fp8_read_over[0]
    assert over_k > 0 and over_v == 0  # V's max over its scale 0.03 is 299: every product at or below 448


def test_nvfp4_needs_head_dim_in_blocks_of_16():
    with pytest.raises(Fp8kvError, match=r"head_dim \[40\] is not a multiple; serve this model with an fp8 cache"):
        Nvfp4PagedKVCache([0], num_pages=2, page_size=4, num_kv_heads=1, head_dim=40, device=CPU)


def test_bytes_per_token_are_the_codes_and_block_scales():
    """2 layers x 2 heads x (K, V) x (16 code bytes + 2 block-scale bytes) for head_dim 32: 9/16 of fp8's bytes."""
    assert _cache().bytes_per_token() == 2 * 2 * 2 * (16 + 2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("models") / "llama", hidden_size=128, num_heads=4)


def _logits(model_dir, prompt, **kwargs):
    runner = PagedModelRunner(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_seqs=2, **kwargs)
    seq, _ = runner.start()
    return runner, runner.step([(seq, prompt)])[0]


def test_the_runner_attends_over_the_nvfp4_read_back_coarser_than_fp8(llama):
    """At ModelOpt's scales (amax / 448) on this random model: the largest logit error relative to a float32 cache's
    logits was 0.030 with fp8 e4m3, 0.093 with nvfp4, 0.103 with nvfp4_4over6, 0.093 with its fp8 read, and 0.093
    with fp8_k_nvfp4_v (the largest error is the first token's, whose attention reads its V alone)."""
    prompt = [(7 * i + 11) % 500 + 4 for i in range(23)]
    plain, reference = _logits(llama, prompt, cache_dtype="fp32")
    amax = plain.counts().amax  # per layer (K, V) per head
    k_scales = {layer: max(k) / 448 for layer, (k, _) in amax.items()}
    v_scales = {layer: max(v) / 448 for layer, (_, v) in amax.items()}

    def error(**kwargs) -> float:
        runner, logits = _logits(llama, prompt, k_scales=k_scales, v_scales=v_scales, **kwargs)
        if isinstance(runner.cache, Nvfp4PagedKVCache):  # the pages attention read are the stored bytes read back
            assert all(k == v == 0 for k, v in runner.cache.nvfp4_counts().fp8_read_over.values())
            if runner.cache.read == "float32" and not runner.cache.fp8_keys:
                for row, pages in enumerate(runner.cache.pages):
                    scales = runner.cache.scales[row].T.reshape(-1, 1)  # [2*kv_heads, 1]: K0, V0, K1, V1
                    stored = Nvfp4Tensor(runner.cache.codes[row], runner.cache.block_scales[row].view(E4M3), scales)
                    assert torch.equal(pages, dequantize(stored))
        return float((logits - reference).abs().max() / reference.abs().max())

    fp8 = error(cache_dtype="fp8_e4m3")
    for kwargs in ({"cache_dtype": "nvfp4"}, {"cache_dtype": "nvfp4_4over6"},
                   {"cache_dtype": "nvfp4", "nvfp4_read": "fp8", "q_scales": dict.fromkeys(k_scales, 0.05)},
                   {"cache_dtype": "fp8_k_nvfp4_v"}):
        assert fp8 < error(**kwargs) < 0.2, kwargs


@pytest.mark.parametrize("read", ["float32", "fp8"])
def test_only_the_fp8_read_hands_o_proj_an_attention_output_rounded_to_e4m3(llama, read):
    runner = PagedModelRunner(llama, device="cpu", page_size=4, max_model_len=64, max_num_seqs=2, cache_dtype="nvfp4",
                              k_scales=dict.fromkeys((0, 1), 0.01), v_scales=dict.fromkeys((0, 1), 0.01),
                              nvfp4_read=read)
    seen = []
    runner.model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    seq, _ = runner.start()
    runner.step([(seq, [5, 9, 14, 3, 77])])
    out = seen[0].float()
    in_e4m3 = torch.equal(to_fp8(out, E4M3, saturate=True).float(), out)
    assert in_e4m3 == (read == "fp8") and runner.cache.fp8_attention_output == (read == "fp8")


def _page_cache(head_dim: int, page_size: int = 4) -> Nvfp4PagedKVCache:
    cache = Nvfp4PagedKVCache([0], num_pages=2, page_size=page_size, num_kv_heads=2, head_dim=head_dim, device=CPU)
    # stored bytes counting up (mod 251): where one lands in the page says where it came from
    for stored in (cache.codes[0], cache.block_scales[0]):
        stored.copy_(torch.arange(stored.numel()).remainder(251).view(stored.shape))
    return cache


def test_a_vllm_page_puts_each_byte_where_vllms_split_views_read_it():
    """vLLM 0.32.0's `nvfp4_split_data_scale` (tests/golden/nvfp4-vllm-0.32.0.json) on one side of an HND page whose
    bytes hold their offsets: its code view at (head, token, byte) reads offset codes[...], its block-scale view
    likewise. fp8kv's page must hold K's code and block-scale bytes at those offsets, and V's one side further."""
    recorded = json.loads((Path(__file__).parent / "golden" / "nvfp4-vllm-0.32.0.json").read_text())
    split = recorded["nvfp4_split_data_scale"]
    heads, page_size, head_dim = split["kv_heads"], split["page_size"], split["head_dim"]
    cache = _page_cache(head_dim, page_size)
    page = cache.vllm_page(0, 1, swizzle_v=False)
    side_bytes = heads * page_size * (head_dim // 2 + head_dim // 16)
    assert page.numel() == 2 * side_bytes
    for side in (0, 1):
        codes = page[side * side_bytes + torch.tensor(split["codes"])].view(heads, page_size, head_dim // 2)
        scales = page[side * side_bytes + torch.tensor(split["block_scales"])].view(heads, page_size, head_dim // 16)
        assert torch.equal(codes, cache.codes[0][1, :, side::2].transpose(0, 1))
        assert torch.equal(scales, cache.block_scales[0][1, :, side::2].transpose(0, 1))


def test_sm100s_v_scale_swizzle_moves_token_t_block_s_where_vllms_kernel_writes_it():
    """vLLM 0.32.0's `swizzle_scale_offset` (nvfp4_kv_cache_kernels.cu, read): with S = head_dim / 16 scales a token,
    token t's block s goes to row (t // 4) * 4 + s // (S / 4), column (s % (S / 4)) * 4 + t % 4. K stays linear."""
    head_dim, page_size = 128, 8
    cache = _page_cache(head_dim, page_size)
    linear, swizzled = cache.vllm_page(0, 1, swizzle_v=False), cache.vllm_page(0, 1, swizzle_v=True)
    side_bytes = 2 * page_size * (head_dim // 2 + head_dim // 16)
    assert torch.equal(linear[:side_bytes], swizzled[:side_bytes])
    scales_at = side_bytes + 2 * page_size * head_dim // 2  # V's block scales: [kv_heads, page_size, S]
    blocks = head_dim // 16
    v_linear = linear[scales_at:].view(2, page_size, blocks)
    v_swizzled = swizzled[scales_at:].view(2, page_size, blocks)
    group = blocks // 4
    for t in range(page_size):
        for s in range(blocks):
            row, column = (t // 4) * 4 + s // group, (s % group) * 4 + t % 4
            assert torch.equal(v_swizzled[:, row, column], v_linear[:, t, s])
    with pytest.raises(Fp8kvError, match="a head_dim that is a multiple of 64"):
        _page_cache(32).vllm_page(0, 1, swizzle_v=True)


FLASHINFER = json.loads((Path(__file__).parent / "golden" / "nvfp4-flashinfer-0.7.0.post1.json").read_text())


@pytest.mark.parametrize("recorded", FLASHINFER["swizzled"], ids=lambda r: f"page_size={r['page_size']},head_dim={r['head_dim']}")
def test_each_v_block_scale_byte_sits_where_flashinfers_own_swizzle_puts_it(recorded):
    """FlashInfer 0.7.0.post1's `nvfp4_quantize_paged_kv_cache` (the release vLLM 0.32.0 pins; its kernel replaced by
    one whose linear block scale i is byte i, so each output byte names its block) swizzles V's block scales for
    trtllm-gen and keeps K's linear: fp8kv's sm100 page must hold the same bytes, page by page."""
    pages, heads, page_size, head_dim = (recorded[key] for key in ("num_pages", "kv_heads", "page_size", "head_dim"))
    blocks = head_dim // 16
    cache = Nvfp4PagedKVCache([0], num_pages=pages, page_size=page_size, num_kv_heads=heads, head_dim=head_dim,
                              device=CPU)
    # FlashInfer's linear input is [pages, heads, page_size, blocks]: block i of it holds byte i, on both sides
    labels = torch.arange(pages * heads * page_size * blocks).view(pages, heads, page_size, blocks).to(torch.uint8)
    cache.block_scales[0].copy_(labels.transpose(1, 2).repeat_interleave(2, dim=2))  # [pages, page_size, 2*heads, blocks]
    k_scales = torch.tensor(list(bytes.fromhex(recorded["k_scales"])), dtype=torch.uint8).view(pages, -1)
    v_scales = torch.tensor(list(bytes.fromhex(recorded["v_scales"])), dtype=torch.uint8).view(pages, -1)
    codes, scales = heads * page_size * head_dim // 2, heads * page_size * blocks
    for page in range(pages):
        stored = cache.vllm_page(0, page, swizzle_v=True)  # [K codes | K scales | V codes | V scales]
        assert torch.equal(stored[codes:codes + scales], k_scales[page])
        assert torch.equal(stored[2 * codes + scales:], v_scales[page])


@pytest.mark.parametrize("refused", FLASHINFER["refused"], ids=lambda r: f"page_size={r['page_size']},head_dim={r['head_dim']}")
def test_the_swizzle_is_refused_where_flashinfer_refuses_it(refused):
    cache = _page_cache(refused["head_dim"], refused["page_size"])
    with pytest.raises(Fp8kvError, match="needs a page size and head_dim / 16 that are multiples of 4"):
        cache.vllm_page(0, 1, swizzle_v=True)
