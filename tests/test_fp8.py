"""The fp8 facts every stage imports: MAX, the plain cast's limits, and fp8kv's own cast.

The expected bytes are written out, and the same bytes must come back whether torch's cast stores NaN past
the range (torch < 2.12) or saturates (torch >= 2.12), each emulated where the installed torch differs:
fp8kv decides every out-of-range value itself.
"""

from __future__ import annotations

import pytest
import torch

from fp8kv.fp8 import (FP8_DTYPES, canonical_cache_dtype, nonfinite, reads_differently, to_float32, to_fp8,
                      truncate_to_fp8)
from fp8kv.kvdtypes import FP8_MAX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUTS = [448.0, -448.0, 464.0, 464.0001, 1000.0, float("inf"), float("-inf"), float("nan"), 1.0]
# e4m3fn: 0x7E is 448 (S.1111.110), 0x7F / 0xFF NaN; 464 rounds down to 448, anything above is NaN.
E4M3_BYTES = {
    True: [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x38],
    False: [0x7E, 0xFE, 0x7E, 0x7F, 0x7F, 0x7F, 0xFF, 0x7F, 0x38],
}
E5M2_INPUTS = [57344.0, 61439.0, 61440.0, -61440.0, float("inf"), float("-inf"), float("nan"), 1.0]
# e5m2: 0x7B is 57344 (S.11110.11), 0x7C / 0xFC ±inf, 0x7F NaN; 61440 is the first value that overflows.
E5M2_BYTES = {
    True: [0x7B, 0x7B, 0x7B, 0xFB, 0x7B, 0xFB, 0x7F, 0x3C],
    False: [0x7B, 0x7B, 0x7C, 0xFC, 0x7C, 0xFC, 0x7F, 0x3C],
}


# vLLM's CPU conversion (the bytes its cpu_attn_reshape_and_cache stored for these values, vLLM 0.32 on x86):
# clamped (NaN to +MAX), then rounded toward zero; a zero of either sign is +0, a negative one cut to zero is -0.
# 15.9 is 0x57 (15), 1.124 is 0x38 (1.0; to nearest it would be 1.125); 2**-9 - 2**-30 is 0x01: the e4m3 path
# multiplies by 2**-120 first, and that float32 subnormal rounds up to 2**-129 before the bits are cut.
TRUNCATED_E4M3 = {1000.0: 0x7E, -1000.0: 0xFE, float("nan"): 0x7E, float("inf"): 0x7E, -0.0: 0x00, 15.9: 0x57,
                  -15.9: 0xD7, 2**-9 - 2**-30: 0x01, 2**-10: 0x00, -(2**-10): 0x80, 1.124: 0x38, -464.0: 0xFE}
TRUNCATED_E5M2 = {1e5: 0x7B, float("nan"): 0x7B, float("-inf"): 0xFB, 1.24: 0x3C, 2**-17: 0x00, 3 * 2**-17: 0x01,
                  -3 * 2**-17: 0x81, 57344.0: 0x7B, -0.0: 0x00}


def bytes_of(stored: torch.Tensor) -> list[int]:
    return stored.view(torch.uint8).tolist()


@pytest.mark.parametrize("saturate", [True, False])
def test_out_of_range_bytes_do_not_depend_on_torchs_cast(cast, saturate):
    plain = bytes_of(torch.tensor([1000.0]).to(E4M3))
    assert plain == ([0x7E] if cast == "saturating" else [0x7F])  # the two torches differ here
    assert bytes_of(to_fp8(torch.tensor(INPUTS), E4M3, saturate=saturate)) == E4M3_BYTES[saturate]
    assert bytes_of(to_fp8(torch.tensor(E5M2_INPUTS), E5M2, saturate=saturate)) == E5M2_BYTES[saturate]


@pytest.mark.parametrize("dtype, expected", [(E4M3, TRUNCATED_E4M3), (E5M2, TRUNCATED_E5M2)], ids=["e4m3", "e5m2"])
def test_the_truncating_conversion_stores_vllm_cpus_bytes(cast, dtype, expected):
    assert bytes_of(truncate_to_fp8(torch.tensor(list(expected)), dtype)) == list(expected.values())


def test_truncation_never_stores_a_larger_magnitude_and_stays_within_one_step(cast):
    y = (torch.randn(20000) * torch.logspace(-4, 3, 20000)).clamp(-448, 448)
    cut, nearest = truncate_to_fp8(y, E4M3).float(), y.to(E4M3).float()
    assert bool((cut.abs() <= y.abs()).all())
    assert bool(((nearest - cut).abs() <= (nearest.abs() / 8).clamp(min=2**-9)).all())  # one e4m3 step at most
    assert 0.3 < float((cut != nearest).float().mean()) < 0.7  # to nearest rounds up about half the time


def test_a_bf16_input_is_judged_by_its_own_value(cast):
    y = torch.tensor([464.0, 466.0, 61440.0], dtype=torch.bfloat16)  # 466 is bf16-representable
    assert bytes_of(to_fp8(y[:2], E4M3, saturate=False)) == [0x7E, 0x7F]
    assert bytes_of(to_fp8(y[2:], E5M2, saturate=False)) == [0x7C]


def test_fp8_max_and_vllm_spelling():
    assert FP8_MAX == {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
    assert set(FP8_DTYPES.values()) == {E4M3, E5M2}
    assert canonical_cache_dtype("fp8") == "fp8_e4m3"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_nonfinite_reads_every_fp8_code_as_its_float_value_does(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert torch.equal(nonfinite(codes), ~torch.isfinite(codes.float()))
    assert int(nonfinite(codes).sum()) == (2 if dtype == torch.float8_e4m3fn else 8)  # ±NaN; ±inf and 6 NaNs


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_to_float32_gives_torchs_bits_for_every_code_in_new_memory(dtype):
    """Every code, NaNs and negative zero included, read through a strided view (K of interleaved K and V)."""
    interleaved = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8).view(dtype).view(2, 128, 2)
    for x in (interleaved, interleaved[..., 0], interleaved[..., 1]):
        widened = to_float32(x)
        assert widened.dtype == torch.float32 and widened.shape == x.shape
        assert torch.equal(widened.view(torch.int32), x.to(torch.float32).view(torch.int32))
    wide = torch.ones(3)
    assert to_float32(wide).data_ptr() != wide.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nonfinite_reads_every_16_bit_value_as_isfinite_does(dtype):
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert torch.equal(nonfinite(values), ~torch.isfinite(values))


def test_nonfinite_reads_float32_as_isfinite_does():
    edges = torch.tensor([0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x00000001, 0x00800000, 0],
                         dtype=torch.int64)
    bits = torch.cat([edges, edges | (1 << 31), torch.randint(0, 1 << 32, (100_000,), generator=torch.Generator().manual_seed(0))])
    values = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # each 32-bit pattern as a signed int
    assert torch.equal(nonfinite(values), ~torch.isfinite(values))
    assert int(nonfinite(values[:16]).sum()) == 8


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_two_codes_read_differently_exactly_where_their_values_do(dtype):
    a = torch.arange(256, dtype=torch.uint8).repeat_interleave(256).view(dtype)
    b = torch.arange(256, dtype=torch.uint8).repeat(256).view(dtype)
    wide_a, wide_b = a.float(), b.float()
    assert torch.equal(reads_differently(a, b), (wide_a != wide_b) & ~(wide_a.isnan() & wide_b.isnan()))
    assert not reads_differently(torch.tensor([0x00, 0x7F], dtype=torch.uint8).view(dtype),
                                 torch.tensor([0x80, 0xFF], dtype=torch.uint8).view(dtype)).any()  # ±0, ±NaN
