"""NVFP4 KV-cache numerics: vLLM's CUDA write, its read-back, and what a verifier counts per write.

A value is stored as a 4-bit e2m1 code; each block of 16 consecutive head_dim values shares one e4m3 block scale SF,
and each layer and side one float32 scale s (the checkpoint's k_scale / v_scale), so a value reads back as
`e2m1 * SF * s`. vLLM's write (`csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu` and
`quantization/fp4/nvfp4_utils.cuh` `cvt_warp_fp16_to_fp4`, late 2026), per block with bmax = max |x|:

    g    = 1 / s
    SF   = e4m3(g * (bmax * rcp(6)))     round to nearest even, saturating at 448
    y    = x * rcp(SF * rcp(g))          0 where SF is 0
    code = e2m1(y)                       round to nearest even, saturating at ±6

The kernel's `rcp` is `rcp.approx.ftz.f32`, which PTX documents to within 1 ulp of 1/x; `_reciprocal` here is
float32's correctly rounded 1/x, so a code or block scale can differ from the GPU's only where a product lands within
a few float32 ulps of an e2m1 or e4m3 rounding boundary (tests/test_nvfp4.py measures how often, and that such a
value is one step off at most). Flushing subnormals changes nothing for scales between 2**-117 and 2**117: no
operand or result of those reciprocals is subnormal there. A block holding NaN is not modelled: the kernel's
half-precision max passes over a NaN, torch's amax keeps it.

On a CPU the write runs in a small C kernel (nvfp4.c), one pass per block of 16 where torch makes many
passes over the values: each block's codes, block scale, counts and, for the cache, the values it reads back, the
bits `torch_quantize` gives (every product and sum rounded on its own, as torch's elementwise operations round).
Each process builds it with the system's C compiler (`$CC`, else `cc`) on first use (`ckernel.build`); where it
does not build, or the tensors are not on the CPU, torch writes (`quantize_route` says which).

FlashInfer's slot-mapping writer, which vLLM 0.32.0 runs for nvfp4 on sm80, sm90 and sm120 (0.7.0.post1
`include/flashinfer/page.cuh` `nvfp4_append_quantize_block`), orders the same arithmetic otherwise: SF = e4m3(bmax /
(6 * s)), y = x * (1 / (SF * s)), e2m1 by its own table of midpoints (to nearest even, ±6 past the range), under
nvcc's `-use_fast_math`. Rounded to nearest, it stores the bytes this write does on every block
tests/test_nvfp4_vendor.py compares; the two could part only where a quotient lands within float32 roundings of an
e4m3 or e2m1 midpoint.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import torch

from fp8kv.ckernel import build, route
from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import FP8_DTYPES, to_float32, to_fp8
from fp8kv.kvdtypes import E2M1_MAGNITUDES, E2M1_MAX, FP8_MAX, NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SCALE_DTYPE

E4M3 = FP8_DTYPES[NVFP4_BLOCK_SCALE_DTYPE]
SIGN_BIT = 0x8
_MAX_CODE = len(E2M1_MAGNITUDES) - 1
# The 4over6 write's second block-scale target: 4 maps a block's max to e2m1's 4, where 6 maps it to 6
FOUR_OVER_SIX_TARGET = 4.0
KERNEL_SOURCE = Path(__file__).with_name("nvfp4.c")
# torch rounds each product and sum on its own: no fused multiply-adds (GCC's default with -march=native), no fast-math
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math")
# what a write also hands back: each value's e2m1 * block scale (`block_values`), or its read-back (`dequantize`)
ReadBack = Literal["block_values", "dequantize"]


@dataclass(frozen=True)
class Nvfp4Tensor:
    """A tensor held as NVFP4. `codes` uint8 `[..., n/2]`: two e2m1 codes a byte (`pack`); `block_scales`
    float8_e4m3fn `[..., n/16]`; `scale` float32, broadcasting against `block_scales`: value i reads back as
    `e2m1(code i) * block_scales[i // 16] * scale`."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    scale: torch.Tensor


class Decoded(NamedTuple):
    """What a write's stored values read back as, from the same pass (`quantize_read_back`)."""

    values: torch.Tensor  # [..., n] float32: `block_values(stored)` or `dequantize(stored)`, as asked
    past_e4m3: torch.Tensor  # int64 0-dim: values whose e2m1 * block scale is past e4m3's 448


@dataclass(frozen=True)
class WriteCounts:
    """What one NVFP4 write did, as int64 0-dim tensors on the tensor's device (no host sync)."""

    saturated_scales: torch.Tensor  # blocks with bmax / target / s > 448: the block scale is 448 and values clip
    subnormal_scales: torch.Tensor  # blocks whose block scale is an e4m3 subnormal (below 2**-6): 3 bits or fewer
    zeroed_blocks: torch.Tensor  # blocks holding a nonzero value whose block scale rounded to 0: all stored as ±0
    clipped_values: torch.Tensor  # values with |x / (SF * s)| > 6, stored as ±6 (e4m3's rounding of SF alone: to 6.375)


class _Candidate(NamedTuple):
    """One block-scale choice, per block `[..., blocks]`."""

    wanted: torch.Tensor  # float32 g * bmax / target, before the e4m3 cast
    block_scale: torch.Tensor  # float8_e4m3fn
    output_scale: torch.Tensor  # float32 multiplier from x to e2m1's range; 0 where the block scale is 0


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """`y` as e2m1 codes (uint8, 0..15; bit 3 the sign): round to nearest even, ±6 past the range and for ±inf, as
    CUDA's `__nv_cvt_float_to_fp4(y, __NV_E2M1, cudaRoundNearest)` (and `cvt.rn.satfinite.e2m1x2.f32`). The sign
    is y's sign bit, so -0 and a negative value that rounds to 0 store code 8; NaN stores +6, as cuda_fp4.hpp's
    host conversion does."""
    y, magnitude_code = _rounded(y)
    sign = (y.view(torch.int32) >> 28) & SIGN_BIT  # float32's sign bit, moved to bit 3
    return (magnitude_code.to(torch.int32) | sign).to(torch.uint8)


def e2m1_rounded(y: torch.Tensor) -> torch.Tensor:
    """`e2m1_values(e2m1_codes(y))` in float32, without the codes: 2c - 8, c - 2 and c / 2 of magnitude code c are
    its value (6, 4, 3, 2, 1.5, 1, 0.5, 0) where each is largest, with y's sign."""
    y, code = _rounded(y)
    return torch.copysign(torch.maximum(torch.maximum(code * 0.5, code - 2), code * 2 - 8), y)


def _rounded(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`y` in float32 with NaN as +inf (code 7, no sign; ±inf kept), and its e2m1 magnitude code (0..7) as float32.

    e2m1's magnitudes step by 0.5 below 2, by 1 up to 4, by 2 above, and a tie goes to the even code (0.25, 1.25,
    2.5, 5 down; 0.75, 1.75, 3.5 up). Rounding 2|y|, |y| + 2 and |y|/2 + 4 to nearest even gives the code within
    each range, and |y|'s own range gives the smallest of the three. Each is exact but for its one rounding: a few
    float32 passes, where comparisons with the seven bounds cost several times as much on a CPU."""
    y = torch.nan_to_num(y.float(), nan=math.inf, posinf=math.inf, neginf=-math.inf)
    magnitude = y.abs()
    code = torch.minimum(torch.round(magnitude * 2), torch.round(magnitude) + 2)
    return y, torch.minimum(code, (torch.round(magnitude * 0.5) + 4).clamp_(max=_MAX_CODE))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) as float32; code 8 reads as -0.0."""
    return torch.take(_code_values(codes.device), codes.long())


@functools.cache
def _code_values(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes]).to(device)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes a byte along the last axis, `[..., n]` -> `[..., n/2]`, the even-indexed one in the low
    nibble: vLLM's kernel hands `cvt.rn.satfinite.e2m1x2.f32` the odd value as the instruction's high half."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack` packed: `[..., n/2]` -> `[..., n]`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x rounded to nearest in float32, where the kernel runs `rcp.approx.ftz.f32` (see the module's docstring)."""
    return torch.reciprocal(x)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, *,
             four_over_six: bool = False) -> tuple[Nvfp4Tensor, WriteCounts]:
    """`x` `[..., n]` (n a multiple of 16) written as vLLM's NVFP4 KV cache stores it with global scale `scale`
    (float32 s, the checkpoint's k_scale or v_scale, broadcasting against `x.shape[:-1] + (1,)`), and the counts.

    `four_over_six` is vLLM's 4over6 cache (`torch_quantize`, the reference, states the arithmetic). On a CPU a
    small C kernel (nvfp4.c) writes each block in one pass, the bits `torch_quantize` gives; where it does not
    build, or the tensors are elsewhere, torch writes them (`quantize_route` says which).
    """
    stored, counts, _ = _write(x, scale, four_over_six, None)
    return stored, counts


def quantize_read_back(x: torch.Tensor, scale: torch.Tensor | float, *, four_over_six: bool = False,
                       read_back: ReadBack) -> tuple[Nvfp4Tensor, WriteCounts, Decoded]:
    """`quantize`, and what the stored values read back as: `block_values(stored)` or `dequantize(stored)` as
    `read_back` names, from the kernel's one pass where it runs."""
    stored, counts, decoded = _write(x, scale, four_over_six, read_back)
    assert decoded is not None, "asked for"
    return stored, counts, decoded


def _write(x: torch.Tensor, scale: torch.Tensor | float, four_over_six: bool,
           read_back: ReadBack | None) -> tuple[Nvfp4Tensor, WriteCounts, Decoded | None]:
    _check_blocks(x)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    rows = (*x.shape[:-1], 1)
    kernel, _ = _kernel() if x.device.type == "cpu" and torch.broadcast_shapes(s.shape, rows) == rows else (None, "")
    if kernel is None:
        stored, counts = torch_quantize(x, s, four_over_six=four_over_six)
        if read_back is None:
            return stored, counts, None
        products = block_values(stored)
        past_e4m3 = (products.abs() > FP8_MAX[NVFP4_BLOCK_SCALE_DTYPE]).sum()
        return stored, counts, Decoded(products if read_back == "block_values" else dequantize(stored), past_e4m3)
    n = x.shape[-1]
    blocks = x.float().contiguous()
    g = torch.broadcast_to(_reciprocal(s), rows).contiguous()
    s_rows = torch.broadcast_to(s, rows).contiguous()
    codes = torch.empty(*x.shape[:-1], n // 2, dtype=torch.uint8)
    block_scales = torch.empty(*x.shape[:-1], n // NVFP4_BLOCK_SIZE, dtype=torch.uint8)
    values = torch.empty(x.shape, dtype=torch.float32) if read_back else None
    tally = torch.zeros(len(fields(WriteCounts)) + 1, dtype=torch.int64)  # and the values past e4m3's 448
    kernel(blocks.data_ptr(), g.data_ptr(), s_rows.data_ptr() if read_back == "dequantize" else None, g.numel(),
           n // NVFP4_BLOCK_SIZE, four_over_six, _e4m3_values().data_ptr(), codes.data_ptr(), block_scales.data_ptr(),
           None if values is None else values.data_ptr(), tally.data_ptr())
    *written, past_e4m3 = tally.unbind()
    return (Nvfp4Tensor(codes, block_scales.view(E4M3), s), WriteCounts(*written),
            None if values is None else Decoded(values, past_e4m3))


def torch_quantize(x: torch.Tensor, scale: torch.Tensor | float, *,
                   four_over_six: bool = False) -> tuple[Nvfp4Tensor, WriteCounts]:
    """`quantize` in torch, a few passes over the values per step (the kernel's reference and fallback).

    `four_over_six` is vLLM's `nvfp4_4over6` cache: per block, the block scale that maps the block's max to 4 as well
    as the one mapping it to 6, keeping 4 where its squared read-back error is strictly lower.
    """
    _check_blocks(x)
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., blocks, 16]
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    g = _reciprocal(s)
    bmax = _block_max(blocks.abs())
    chosen = _candidate(bmax, g, E2M1_MAX)
    if four_over_six:
        chosen = _lower_error(blocks, chosen, _candidate(bmax, g, FOUR_OVER_SIX_TARGET))
    y = blocks * chosen.output_scale[..., None]
    stored = Nvfp4Tensor(pack(e2m1_codes(y).flatten(-2)), chosen.block_scale, s)
    return stored, _counts(bmax, chosen, y)


def quantize_route() -> str:
    """How `quantize` writes on this machine's CPU: the compiled kernel, or torch and why."""
    return route(_kernel())


@functools.cache
def _kernel() -> tuple[Callable[..., None] | None, str]:
    """The kernel's function (None where there is none) and how it came or why not (`ckernel.build`)."""
    return build(KERNEL_SOURCE, "nvfp4_write", COMPILE_FLAGS,
                 [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 5)


@functools.cache
def _e4m3_values() -> torch.Tensor:
    """Every e4m3 byte as float32, as `to_float32` reads it: the kernel's block scales."""
    return to_float32(torch.arange(256, dtype=torch.uint8).view(E4M3))


def _check_blocks(x: torch.Tensor) -> None:
    if x.shape[-1] % NVFP4_BLOCK_SIZE:
        raise Fp8kvError(f"NVFP4 stores blocks of {NVFP4_BLOCK_SIZE} values: the last dimension of a {tuple(x.shape)} "
                         f"tensor is not a multiple of {NVFP4_BLOCK_SIZE}; pad head_dim to one")


def _block_max(magnitude: torch.Tensor) -> torch.Tensor:
    """Each block's max `[..., blocks]` of `[..., blocks, 16]`, NaN where it holds one, as amax gives it: halves
    folded with maximum, which a CPU runs faster than a reduction over 16 values."""
    while magnitude.shape[-1] > 1:
        half = magnitude.shape[-1] // 2
        magnitude = torch.maximum(magnitude[..., :half], magnitude[..., half:])
    return magnitude[..., 0]


def _candidate(bmax: torch.Tensor, g: torch.Tensor, target: float) -> _Candidate:
    wanted = g * (bmax * _reciprocal(torch.tensor(target, device=bmax.device)))
    block_scale = to_fp8(wanted, E4M3, saturate=True)
    sf = to_float32(block_scale)
    output_scale = torch.where(sf == 0, 0.0, _reciprocal(sf * _reciprocal(g)))
    return _Candidate(wanted, block_scale, output_scale)


def _lower_error(blocks: torch.Tensor, six: _Candidate, four: _Candidate) -> _Candidate:
    """Per block, `four` where its squared error is strictly below `six`'s, else `six`."""
    use_four = _squared_error(blocks, four.output_scale) < _squared_error(blocks, six.output_scale)
    block_scale = torch.where(use_four, four.block_scale.view(torch.uint8), six.block_scale.view(torch.uint8))
    return _Candidate(torch.where(use_four, four.wanted, six.wanted), block_scale.view(E4M3),
                      torch.where(use_four, four.output_scale, six.output_scale))


def _squared_error(blocks: torch.Tensor, output_scale: torch.Tensor) -> torch.Tensor:
    """Per block, the sum of (e2m1(x * output_scale) * rcp(output_scale) - x)**2 in float32, in the kernel's order:
    neighbouring pairs summed, then the pairs added one after another. A zero scale reads back zeros.

    nvcc may fuse these multiplies and adds, rounding once where this rounds twice: the choice can then differ from
    the GPU's only for blocks whose two errors agree to within a few float32 roundings."""
    multiplier = output_scale[..., None]
    read_back = torch.where(multiplier == 0, 0.0, _reciprocal(multiplier))
    error = (e2m1_rounded(blocks * multiplier) * read_back - blocks) ** 2
    pairs = error[..., 0::2] + error[..., 1::2]
    total = pairs[..., 0]
    for i in range(1, pairs.shape[-1]):
        total = total + pairs[..., i]
    return total


def _counts(bmax: torch.Tensor, chosen: _Candidate, y: torch.Tensor) -> WriteCounts:
    sf = to_float32(chosen.block_scale)
    return WriteCounts(
        saturated_scales=(chosen.wanted > FP8_MAX[NVFP4_BLOCK_SCALE_DTYPE]).sum(),
        subnormal_scales=((sf > 0) & (sf < torch.finfo(E4M3).smallest_normal)).sum(),
        zeroed_blocks=((sf == 0) & (bmax > 0)).sum(),
        clipped_values=(y.abs() > E2M1_MAX).sum(),
    )


def block_values(stored: Nvfp4Tensor) -> torch.Tensor:
    """Each value's e2m1 times its block scale, `[..., n]` float32, without the global scale: exact (at most 6
    significant bits), what an attention that applies the global scale itself starts from."""
    values = e2m1_values(unpack(stored.codes)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., blocks, 16]
    return (values * to_float32(stored.block_scales)[..., None]).flatten(-2)


def dequantize(stored: Nvfp4Tensor) -> torch.Tensor:
    """The float32 values `stored` reads back as, `[..., n]`: each e2m1 value times (block scale * scale), the
    product vLLM's pure-torch reference (`dequantize_to_dtype`) forms."""
    values = e2m1_values(unpack(stored.codes)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., blocks, 16]
    block = to_float32(stored.block_scales) * stored.scale  # [..., blocks]
    return (values * block[..., None]).flatten(-2)
