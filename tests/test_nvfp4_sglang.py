"""SGLang 0.5.23's NVFP4 cache against fp8kv's: what of its write and read runs on a CPU, recorded by
probes/sglang_nvfp4_write.py in tests/golden/nvfp4-sglang-write-0.5.23.json. Its quantize is FlashInfer 0.7.2's CUDA
`nvfp4_kv_quantize`, which refuses a CPU (recorded); its arithmetic is compared with vLLM's in docs/nvfp4-numerics.md."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from fp8kv.fp8 import to_float32, to_fp8
from fp8kv.nvfp4 import E4M3, Nvfp4Tensor, block_values, dequantize, e2m1_codes, pack, quantize, unpack
from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache

RECORDED = json.loads((Path(__file__).parent / "golden" / "nvfp4-sglang-write-0.5.23.json").read_text())
SWIZZLES = RECORDED["v_scale_swizzle"]
READS = RECORDED["dequantize"]["reads"]
# values whose float32 e2m1 * (SF * s) is not (e2m1 * SF) * s, per global scale (measured here)
FLOAT32_APART = {"1": 0, "0.0123": 0, "0.0738": 540, "0.00223214": 570}


def test_the_record_is_sglang_0_5_23_run_and_its_quantize_refused_a_cpu_for_both_gpu_generations():
    assert (RECORDED["how"], RECORDED["meta"]["sglang"], RECORDED["meta"]["flashinfer"]) == ("run", "0.5.23", "0.7.2")
    assert RECORDED["quantize_on_cpu"] == {gpu: "ValueError: device must be a cuda device" for gpu in ("sm100", "sm120")}


@pytest.mark.parametrize("recorded", SWIZZLES, ids=lambda r: f"page_size={r['page_size']},scale_dim={r['scale_dim']}")
def test_each_v_block_scale_sits_where_sglangs_sm100_swizzle_puts_it(recorded):
    """SGLang's `nvfp4_v_scale_swizzle_indices` (the torch statement of its Triton store's V-scale layout for sm100's
    trtllm-gen): token t's block s of a page goes to `positions[t * scale_dim + s]`. fp8kv's sm100 page must hold
    each labelled V scale there; K's scales stay linear in both."""
    page_size, blocks = recorded["page_size"], recorded["scale_dim"]
    cache = Nvfp4PagedKVCache([0], num_pages=2, page_size=page_size, num_kv_heads=1, head_dim=16 * blocks,
                              device=torch.device("cpu"))
    labels = torch.arange(page_size * blocks, dtype=torch.uint8).view(page_size, blocks)
    cache.block_scales[0][1, :, 1] = labels  # V of the one head: [page_size, blocks]
    cache.block_scales[0][1, :, 0] = labels  # K
    page = cache.vllm_page(0, 1, swizzle_v=True)  # [K codes | K scales | V codes | V scales]
    scales, codes = page_size * blocks, page_size * blocks * 8
    v_scales = page[2 * codes + scales:]
    assert v_scales[torch.tensor(recorded["positions"])].tolist() == labels.flatten().tolist()
    assert page[codes:codes + scales].tolist() == labels.flatten().tolist()


def _bf16_bits(x: torch.Tensor) -> list[int]:
    return (x.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


@pytest.mark.parametrize("read", READS, ids=lambda r: f"s={r['global_scale']:.6g}")
def test_fp8kvs_float32_read_rounded_to_bf16_is_sglangs_read_bit_for_bit(read):
    """SGLang's pure-torch `NVFP4KVQuantizeUtil.dequantize` (the arithmetic of FlashInfer's CUDA `nvfp4_kv_dequantize`
    that sm100 and sm120 call: `(e2m1 * SF) * s` in float32, rounded to bf16) on every packed code byte and every
    non-NaN e4m3 block scale. fp8kv's float32 read forms `e2m1 * (SF * s)`, which differs from that float32 product for
    540 and 570 of the 4,064 values at s = 0.0738 and 1/448 (none at 1 and 0.0123); rounded to bf16, every value is
    the same bits."""
    recorded = RECORDED["dequantize"]
    codes = torch.tensor(list(bytes.fromhex(recorded["code_bytes"])), dtype=torch.uint8)
    block_scales = torch.tensor(list(bytes.fromhex(recorded["block_scale_bytes"])), dtype=torch.uint8).view(E4M3)
    stored = Nvfp4Tensor(codes, block_scales, torch.tensor(read["global_scale"]))
    float32_apart = int((dequantize(stored) != block_values(stored) * stored.scale).sum())
    assert float32_apart == FLOAT32_APART[f"{read['global_scale']:.6g}"]
    bits = _bf16_bits(dequantize(stored).to(torch.bfloat16))
    assert len(bits) == 16 * len(block_scales) == 4064
    assert {i: f"{bits[int(i)]:04x}" for i in read["samples"]} == read["samples"]
    assert hashlib.sha256(struct.pack(f"<{len(bits)}H", *bits)).hexdigest() == read["bf16_sha256"]


def test_sglangs_pure_torch_read_refused_more_than_one_head():
    """Its block scales `[b, m, n/16, 1]` broadcast against values `[b, m*n/16, 16]` only where b = m = 1."""
    assert RECORDED["dequantize"]["two_heads_refused"].startswith("RuntimeError: The size of tensor a (254) must match")


def _flashinfer_write(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer 0.7.2's `nvfp4_kv_quantize` (data/csrc/fp4_kv_quantization.cu, read), which SGLang 0.5.23 calls
    with its held global scale s on sm100 and sm120, its `rcp.approx.ftz` rounded to nearest as fp8kv rounds vLLM's:
    SF = e4m3(rcp(s) * (bmax * rcp(6))), codes e2m1(x * rcp(SF * s)), the multiplier 0 where bmax is 0. vLLM's
    (fp8kv's `quantize`): g = 1/s, the multiplier rcp(SF * rcp(g)), 0 where SF is 0. Packed codes and block scales."""
    blocks = x.float().unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(dim=-1)
    sf = to_fp8(torch.reciprocal(s) * (bmax * torch.reciprocal(torch.tensor(6.0))), E4M3, saturate=True)
    multiplier = torch.where(bmax != 0, torch.reciprocal(to_float32(sf) * s), 0.0)
    return pack(e2m1_codes(blocks * multiplier[..., None]).flatten(-2)), sf


def _hard_blocks(s: float) -> torch.Tensor:
    """Blocks of 16 bf16 values at global scale s: all zero; the e2m1 rounding ties at block scale 1 (max 6); a max on
    the e4m3 midpoint 1.0625 (6.375); past 448 block scales; a subnormal block scale; a block scale that rounds to 0;
    then Gaussian blocks of many magnitudes."""
    ties = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5.0, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25, 0.0])
    maxima = torch.tensor([6.375, 448 * 6 * 4, 0.01, 0.005])
    shaped = torch.cat([torch.zeros(1, 16), ties[None], maxima[:, None] * torch.linspace(-1, 1, 16)])
    generator = torch.Generator().manual_seed(3)
    gaussian = torch.randn(2002, 16, generator=generator) * torch.exp2(torch.randint(-12, 10, (2002, 1), generator=generator))
    return (torch.cat([shaped, gaussian]) * s).to(torch.bfloat16).view(-1, 128)  # [tokens, head_dim 128]


@pytest.mark.parametrize("scale", [1.0, 1 / 448, 0.0123, 0.0738, 0.12])
def test_sglangs_write_as_read_is_fp8kvs_nvfp4_write_but_for_the_codes_of_blocks_whose_scale_rounds_to_0(scale):
    """Block scales agree everywhere, codes wherever the block scale is not 0, and so every read-back value. Where the
    block scale rounds to 0 under a nonzero max, FlashInfer multiplies by rcp(0) (what the GPU stores for ±inf and
    0 * inf was not read) and vLLM by 0; both read back 0. 0.0123 and 0.12 are scales whose float32 1/(1/s) is not s,
    so the two multipliers' inputs differ by one float32 step there; the codes do not, on these values."""
    x = _hard_blocks(scale)
    s = torch.tensor(scale, dtype=torch.float32)
    ours, counts = quantize(x, s)
    codes, block_scales = _flashinfer_write(x, s)
    assert torch.equal(block_scales.view(torch.uint8), ours.block_scales.view(torch.uint8))
    nonzero = (to_float32(block_scales) != 0).repeat_interleave(16, dim=-1)
    assert torch.equal(unpack(codes)[nonzero], unpack(ours.codes)[nonzero])
    assert torch.equal(dequantize(Nvfp4Tensor(codes, block_scales, s)), dequantize(ours))
    assert min(int(counts.zeroed_blocks), int(counts.saturated_scales), int(counts.subnormal_scales)) > 0
