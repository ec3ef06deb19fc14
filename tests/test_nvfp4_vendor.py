"""fp8kv.nvfp4 stores NVIDIA's own bytes: cuda_fp4.hpp's e2m1 and cuda_fp8.hpp's e4m3 conversions (the headers of
the venv's nvidia-cuda-runtime-cu12), compiled for the host by tests/nvfp4_writes.cpp.

Every bf16 and every fp16 bit pattern (65,536 each, NaN and ±inf included) is converted by both sides; the e2m1
codes and the e4m3 bytes must agree on every pattern (NaN: +6 and 0x7F on both sides). The whole cache write (block
scales and packed codes: vLLM's two variants, and FlashInfer's writer transcribed from its source) is compared on
random blocks that reach every block-scale regime, and on blocks built to land on e2m1's ties.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8kv.fp8 import to_fp8
from fp8kv.nvfp4 import E4M3, e2m1_codes, e2m1_values, quantize
from tests.vendor_headers import build

SOURCE = Path(__file__).with_name("nvfp4_writes.cpp")
PATTERNS = 2**16
# Global scales: 1 and 2 keep every product exact, so the tie blocks land on e2m1's ties; the others are not exact
# in float32 and put block scales in e4m3's subnormals (1.0) and past 448 (7.77e-5) for the random blocks.
SCALES = (1.0, 2.0, 0.0123, 1 / 448, 3.3e-3, 7.77e-5, 0.5017)


@pytest.fixture(scope="module")
def nvfp4_writes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(SOURCE, tmp_path_factory.mktemp("vendor") / "nvfp4_writes")


def _run(binary: Path, folder: Path, mode: str, inputs: torch.Tensor, *args: str) -> np.ndarray:
    (folder / "inputs").write_bytes(inputs.float().numpy().tobytes())
    subprocess.run([str(binary), mode, str(folder / "inputs"), str(folder / "out"), *args], check=True)
    return np.fromfile(folder / "out", dtype=np.uint8)


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_codes_are_cudas_on_every_16_bit_pattern(nvfp4_writes, dtype, tmp_path):
    values = _every_pattern(dtype)
    cuda = _run(nvfp4_writes, tmp_path, "convert", values).reshape(4, PATTERNS)
    assert (cuda[0] == cuda[1]).all(), "__nv_cvt_float_to_fp4 and __nv_fp4_e2m1 disagree"
    ours = e2m1_codes(values).numpy()
    mismatches = int((ours != cuda[0]).sum())
    assert mismatches == 0, f"{mismatches} of {PATTERNS} {dtype} patterns differ, first {values[(ours != cuda[0]).argmax()]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e4m3_block_scale_cast_is_cudas_on_every_16_bit_pattern(nvfp4_writes, dtype, cast, tmp_path):
    """Both store every NaN as 0x7F (positive), whatever its sign, under either torch cast."""
    values = _every_pattern(dtype)
    cuda = _run(nvfp4_writes, tmp_path, "convert", values).reshape(4, PATTERNS)
    assert (cuda[2] == cuda[3]).all(), "__nv_cvt_float_to_fp8 and __nv_fp8_e4m3 disagree"
    ours = to_fp8(values.float(), E4M3, saturate=True).view(torch.uint8).numpy()
    mismatches = int((ours != cuda[2]).sum())
    assert mismatches == 0, f"{mismatches} of {PATTERNS} {dtype} patterns differ"
    assert set(cuda[2][values.isnan().numpy()]) == {0x7F}


def test_e2m1_values_are_cudas(nvfp4_writes, tmp_path):
    subprocess.run([str(nvfp4_writes), "decode", str(tmp_path / "out")], check=True)
    cuda = np.fromfile(tmp_path / "out", dtype=np.float32)
    ours = e2m1_values(torch.arange(16, dtype=torch.uint8)).numpy()
    assert ours.view(np.uint32).tolist() == cuda.view(np.uint32).tolist()  # -0.0 for code 8 included


def _random_blocks() -> torch.Tensor:
    """bf16 blocks of 16, each at its own magnitude from 1e-12 to 1e4, some holding zeros and one all zero."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randn(4000, 16, generator=generator) * 10.0 ** (torch.rand(4000, 1, generator=generator) * 16 - 12)
    blocks[::7, ::3] = 0.0
    blocks[1] = 0.0
    return blocks.to(torch.bfloat16)


def _tie_blocks() -> torch.Tensor:
    """Blocks whose max is 6 (a block scale of 1 at a global scale of 1): every other value on an e2m1 tie, or
    one float32 step beside it."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0))])
    values = torch.cat([values, -values, torch.tensor([-0.0, 0.0, -6.0])])
    values = values[values.abs().argsort()]
    rows = values.reshape(-1, 15)
    return torch.cat([torch.full((len(rows), 1), 6.0), rows], dim=1)


@pytest.mark.parametrize("variant", ["6", "4over6", "flashinfer"])
def test_the_cache_write_stores_the_bytes_cudas_conversions_give(nvfp4_writes, variant, tmp_path):
    """vLLM's write, its 4over6 write, and FlashInfer's slot-mapping writer (vLLM's nvfp4 on sm80, sm90 and sm120),
    which fp8kv models by vLLM's: the same bytes on every block, at every scale."""
    four_over_six = variant == "4over6"
    random, ties = _random_blocks(), _tie_blocks()
    regimes = set()
    chose_four = 0
    for scale in SCALES:
        for blocks in (random, ties):
            cuda = _run(nvfp4_writes, tmp_path, "write", blocks, repr(scale), variant)
            stored, counts = quantize(blocks, scale, four_over_six=four_over_six)
            scales, codes = stored.block_scales.view(torch.uint8).flatten().numpy(), stored.codes.flatten().numpy()
            assert (scales == cuda[: len(blocks)]).all(), f"{(scales != cuda[:len(blocks)]).sum()} block scales at {scale}"
            assert (codes == cuda[len(blocks):]).all(), f"{(codes != cuda[len(blocks):]).sum()} code bytes at {scale}"
            regimes |= {name for name, count in vars(counts).items() if count > 0}
            six, _ = quantize(blocks, scale)
            chose_four += int((six.block_scales.view(torch.uint8) != stored.block_scales.view(torch.uint8)).sum())
    assert regimes == {"saturated_scales", "subnormal_scales", "zeroed_blocks", "clipped_values"}
    assert (chose_four > 0) == four_over_six
