"""nvfp4.c, the compiled NVFP4 write: the same codes, block scales, counts and read-back values as torch's
`torch_quantize` bit for bit, on every bf16 value, random blocks over float32's octaves and the edge cases; torch
where it does not build."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import fields

import pytest
import torch

from fp8kv import nvfp4
from fp8kv.kvdtypes import E2M1_MAGNITUDES
from fp8kv.nvfp4 import WriteCounts, block_values, dequantize, quantize, quantize_read_back, torch_quantize

# 1, amax/448 of a unit block, two calibrated scales, a power of two, one whose block scales fall to e4m3's
# subnormals and to 0, one that saturates them at 448
SCALES = [1.0, 1 / 448, 0.0123, 0.0738, 2.0**-7, 1e30, 1e-30]


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The kernel built again by this test, into a temporary folder of its own."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR once, then keeps what it found
    nvfp4._kernel.cache_clear()
    yield tmp_path / "tmp"
    nvfp4._kernel.cache_clear()


def _compiles_here() -> bool:
    return shutil.which(os.environ.get("CC") or "cc") is not None


def _counts(counts: WriteCounts) -> list[int]:
    return [int(getattr(counts, f.name)) for f in fields(WriteCounts)]


def _same_as_torch(x: torch.Tensor, scale: torch.Tensor | float, four_over_six: bool) -> WriteCounts:
    """Assert the kernel's write of `x` and both its read-backs are torch's, bit for bit; torch's counts."""
    assert nvfp4.quantize_route() == "compiled kernel" if _compiles_here() else nvfp4.quantize_route().startswith("torch (")
    expected, expected_counts = torch_quantize(x, scale, four_over_six=four_over_six)
    for read_back, decode in (("block_values", block_values), ("dequantize", dequantize)):
        stored, counts, values = quantize_read_back(x, scale, four_over_six=four_over_six, read_back=read_back)
        assert torch.equal(stored.codes, expected.codes)
        assert torch.equal(stored.block_scales.view(torch.uint8), expected.block_scales.view(torch.uint8))
        assert _counts(counts) == _counts(expected_counts)
        assert torch.equal(values.values.view(torch.int32), decode(expected).view(torch.int32))  # NaN, -0 alike
        assert int(values.past_e4m3) == int((block_values(expected).abs() > 448).sum())
    return expected_counts


@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("scale", SCALES)
def test_every_bf16_value_is_written_as_torch_writes_it(scale, four_over_six) -> None:
    """All 65536 bf16 patterns, neighbours in one block (similar magnitudes, NaNs and infs together) and shuffled."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    shuffled = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(1))]
    for x in (every.view(-1, 4, 64), shuffled.view(-1, 4, 64)):
        counts = _same_as_torch(x, torch.tensor(scale), four_over_six)
        assert int(counts.clipped_values) > 0
    if scale == 1e30:
        assert int(counts.subnormal_scales) > 0 and int(counts.zeroed_blocks) > 0
    if scale == 1e-30:
        assert int(counts.saturated_scales) > 0
        assert int(quantize_read_back(shuffled, scale, read_back="block_values")[2].past_e4m3) > 0


@pytest.mark.parametrize("four_over_six", [False, True])
def test_random_blocks_over_float32s_octaves_and_a_scale_per_head(four_over_six) -> None:
    """Full float32 mantissas, each block at its own octave (2**-140 to 2**120), each head its own global scale,
    as the cache hands its [kv_heads, 1] scales."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(512, 4, 64, generator=generator)
    octaves = torch.randint(-140, 121, (512, 4, 4, 1), generator=generator).float()
    x = (x.unflatten(-1, (4, 16)) * torch.exp2(octaves)).flatten(-2)
    scale = torch.tensor([[1.0], [0.0123], [2.0**-7], [3.7e-3]])
    counts = _same_as_torch(x, scale, four_over_six)
    assert min(_counts(counts)) > 0  # every regime met


@pytest.mark.parametrize("four_over_six", [False, True])
def test_nan_inf_signed_zeros_and_rounding_ties(four_over_six) -> None:
    """Blocks holding NaN, ±inf, -0; e2m1's ties and their float32 neighbours at block scale 1 (bmax 6, s = 1);
    block maxima at and beside e4m3 midpoints (the 4over6 candidate's bmax / 4 is exact)."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0])
    beside = torch.cat([ties, torch.nextafter(ties, torch.zeros(1)), torch.nextafter(ties, torch.full((1,), 9.0))])
    e2m1 = torch.cat([beside, -beside]).view(-1, 8)
    e2m1 = torch.cat([e2m1, torch.full((e2m1.shape[0], 7), 0.5), torch.full((e2m1.shape[0], 1), 6.0)], dim=1)
    scales = torch.tensor(sorted({*range(0x01, 0x7F)})).to(torch.uint8).view(nvfp4.E4M3).float()
    midpoints = (scales[:-1] + scales[1:]) / 2  # exact in float32
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.zeros(1)), torch.nextafter(midpoints, scales.max())])
    maxima = torch.cat([near * 4, near * 6])[:, None] * torch.linspace(1.0, -0.1, 16)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0, -3.0, 5e-45])
    specials = torch.stack([special.roll(i).repeat(2) for i in range(8)] + [torch.full((16,), -0.0)])
    x = torch.cat([e2m1, maxima, specials])
    for scale in (1.0, 2.0**-7, 0.0738):
        _same_as_torch(x, scale, four_over_six)
    assert torch.equal(quantize(e2m1, 1.0)[0].block_scales.float(), torch.ones(e2m1.shape[0], 1))


def test_the_kernel_built_without_avx512_gives_the_same_bits(fresh_build, tmp_path, monkeypatch) -> None:
    """A CPU without AVX-512 runs a block as two 8-float vectors: the same operations, so the same bits."""
    compiler = tmp_path / "cc-without-avx512"
    compiler.write_text('#!/bin/sh\nexec cc "$@" -mno-avx512f\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for four_over_six in (False, True):
        _same_as_torch(every.view(-1, 64), 0.0123, four_over_six)
    assert not list(fresh_build.iterdir())


def test_without_a_compiler_torch_writes_and_says_why(fresh_build, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    route = nvfp4.quantize_route()
    assert route.startswith("torch (/nonexistent/cc -O3") and "No such file" in route
    x = torch.tensor(E2M1_MAGNITUDES * 2)
    stored, counts, values = quantize_read_back(x, 0.5, read_back="dequantize")
    expected, expected_counts = torch_quantize(x, 0.5)
    assert torch.equal(stored.codes, expected.codes) and _counts(counts) == _counts(expected_counts)
    assert torch.equal(values.values, dequantize(expected)) and int(values.past_e4m3) == 0
