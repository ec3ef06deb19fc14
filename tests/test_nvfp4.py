"""fp8kv.nvfp4 on worked examples, its counters on blocks built for each, and how far the GPU's approximate
reciprocals can move what it stores (tests/test_nvfp4_vendor.py holds the bytes against CUDA's conversions)."""

from __future__ import annotations

import pytest
import torch

from fp8kv import nvfp4
from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import E2M1_MAGNITUDES
from fp8kv.nvfp4 import E4M3, dequantize, e2m1_codes, pack, quantize, unpack


def test_two_codes_a_byte_the_even_index_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0xA, 0x7, 0xF]], dtype=torch.uint8)
    assert pack(codes).tolist() == [[0xA1, 0xF7]]
    assert torch.equal(unpack(pack(codes)), codes)


def test_a_block_whose_max_is_6_at_scale_1_stores_its_e2m1_values_exactly():
    """bmax 6 at s = 1: the block scale is e4m3 1.0 and every value is its own code, read back exactly."""
    values = torch.tensor([6.0, *E2M1_MAGNITUDES[1:], -0.5, -1.0, -2.0, -3.0, -4.0, -6.0, 0.0, -0.0])[:16]
    stored, counts = quantize(values, 1.0)
    assert stored.block_scales.float().tolist() == [1.0]
    assert torch.equal(dequantize(stored), values)
    assert unpack(stored.codes).tolist() == e2m1_codes(values).tolist()
    assert [int(c) for c in vars(counts).values()] == [0, 0, 0, 0]


def test_a_global_scale_and_a_block_scale_multiply_on_read_back():
    """bmax 12 at s = 0.5: g = 2, the block scale e4m3(2 * 12 / 6) = 4, values read back as e2m1 * 4 * 0.5."""
    values = torch.tensor([12.0, 1.0, -3.0, 5.0] * 4)
    stored, _ = quantize(values, 0.5)
    assert stored.block_scales.float().tolist() == [4.0]
    assert dequantize(stored).tolist() == [12.0, 1.0, -3.0, 4.0] * 4  # 5 / 2 = 2.5: a tie, to the even 2


def test_each_counter_counts_its_own_regime():
    """One block per regime at s = 1: bmax/6 past 448 (saturated, and values past 6 * 448), below 2**-6 (an e4m3
    subnormal), below half e4m3's smallest subnormal 2**-9 (rounds to 0 while the block is not zero), and normal."""
    bmaxes = torch.tensor([6 * 448 * 4, 6 * 2.0**-8, 6 * 2.0**-11, 6.0, 0.0])
    blocks = bmaxes[:, None] * torch.linspace(1.0, 0.0, 16)  # each block's max first, then smaller values
    stored, counts = quantize(blocks, 1.0)
    assert stored.block_scales.float().flatten().tolist() == [448.0, 2.0**-8, 0.0, 1.0, 0.0]
    assert int(counts.saturated_scales) == 1 and int(counts.subnormal_scales) == 1 and int(counts.zeroed_blocks) == 1
    # the saturated block: values past 6 * 448 clip, 4x its block scale's reach at the top
    assert int(counts.clipped_values) == int((blocks[0] / 448 > 6).sum()) == 12


def test_a_head_dim_that_is_no_multiple_of_16_is_refused_with_the_fix():
    with pytest.raises(Fp8kvError, match=r"last dimension of a \(2, 40\) tensor is not a multiple of 16; pad head_dim"):
        quantize(torch.ones(2, 40), 1.0)


def test_four_over_six_keeps_the_lower_error_and_six_on_a_tie():
    """[4, 3, 3, ...]: mapped to 6 (block scale 2/3 -> e4m3 0.6875) 3 reads back as 2.75; mapped to 4 (block scale 1)
    every value is exact, so 4 wins. An all-zero block ties at error 0 and keeps 6's scale (0 either way)."""
    blocks = torch.stack([torch.tensor([4.0] + [3.0] * 15), torch.zeros(16)])
    six, _ = quantize(blocks, 1.0)
    best, _ = quantize(blocks, 1.0, four_over_six=True)
    assert six.block_scales.float().flatten().tolist() == [0.6875, 0.0]
    assert best.block_scales.float().flatten().tolist() == [1.0, 0.0]
    assert torch.equal(dequantize(best), blocks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e2m1_code_times_every_e4m3_block_scale_is_exact_in_16_bits(dtype):
    """FlashInfer's fa2 attention (vLLM 0.32.0 on sm80, sm90, sm120) converts codes and block scales to the model's
    fp16 or bf16 and multiplies them there: every product (6 x 448 = 2688 at most, 2**-10 at least) is exact in both,
    so that read is the float32 read up to where the global scale enters, and no block overflows as an e4m3 read can."""
    codes = torch.arange(16, dtype=torch.uint8)
    patterns = torch.arange(256, dtype=torch.uint8)
    scales = patterns[patterns & 0x7F != 0x7F].view(E4M3)  # every finite e4m3, subnormals and -0 included
    exact = nvfp4.e2m1_values(codes)[:, None] * scales.float()[None, :]
    assert torch.equal((nvfp4.e2m1_values(codes).to(dtype)[:, None] * scales.to(dtype)[None, :]).float(), exact)
    assert exact.abs().max() == 2688.0 and exact.abs()[exact != 0].min() == 2.0**-10


def _activations() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(4000, 128, generator=generator) * torch.rand(4000, 1, generator=generator) * 8).to(torch.bfloat16)


@pytest.mark.parametrize("direction", [-float("inf"), float("inf")])
@pytest.mark.parametrize("scale", [1.0, 1 / 448, 0.02, 0.0123])
def test_a_reciprocal_one_float32_step_off_moves_a_block_scale_or_a_code_by_one_step_at_most(monkeypatch, scale,
                                                                                            direction):
    """The kernel's rcp.approx.ftz.f32 is within 1 ulp of 1/x; fp8kv rounds to nearest. Moving every reciprocal one
    float32 step (further than the kernel can be from fp8kv's) changes a block scale by one e4m3 code at most and,
    where the block scale stays, a code by one e2m1 step at most. Measured (both directions, these 512,000
    values): no change at 0.0123; at 0.02 and 1/448 up to 0.34 % of codes and 0.74 % of block scales; at 1.0 up to
    1.2 % of codes and 3.4 % of block scales: a power-of-two scale keeps bmax / 6 exact, so a bf16 block max lands
    on an e4m3 rounding midpoint often, and which side the GPU rounds it to is its approximation's choice."""
    x = _activations()
    exact, _ = quantize(x, scale)
    monkeypatch.setattr(nvfp4, "_reciprocal", lambda t: torch.reciprocal(t).nextafter(torch.tensor(direction)))
    moved, _ = quantize(x, scale)
    scale_steps = (exact.block_scales.view(torch.uint8).int() - moved.block_scales.view(torch.uint8).int()).abs()
    assert int(scale_steps.max()) <= 1
    codes, moved_codes = unpack(exact.codes).int(), unpack(moved.codes).int()
    same_scale = (scale_steps == 0).repeat_interleave(16, dim=-1)
    code_steps = ((codes & 7) - (moved_codes & 7)).abs()
    assert int((code_steps * same_scale).max()) <= 1
    assert ((codes != moved_codes).float().mean()) < 0.015
    assert ((scale_steps != 0).float().mean()) < 0.04
