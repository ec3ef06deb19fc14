"""FP8 facts in one place: cache dtype names, MAX, what a plain cast does past MAX, and fp8kv's own cast.

A KV scale is a dequantization multiplier: an engine stores `fp8(x / scale)` and reads
`float(stored) * scale`. How it turns `x / scale` into fp8 differs between engines, and only a
saturating conversion is safe: torch's cast (torch 2.9, CPU and XLA) does not saturate, newer torch's
does on CPU. `to_fp8` decides every out-of-range value itself, so no result depends on the torch installed.
"""

from __future__ import annotations

import functools

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import FP8_MAX, RAW_CAST_FINITE_LIMIT, TORCH_DTYPE_NAME
from fp8kv.options import KV_DTYPE_SPELLINGS

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CACHE_DTYPES = {**FP8_DTYPES, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = KV_DTYPE_SPELLINGS
assert all(torch.finfo(dtype).max == FP8_MAX[name] and str(dtype) == f"torch.{TORCH_DTYPE_NAME[name]}"
           for name, dtype in FP8_DTYPES.items()), "kvdtypes.py disagrees with torch"

# The bytes a non-saturating conversion (torch 2.9's cast, CUDA's c10 conversion) stores past that limit,
# for a positive value (the sign bit is added for a negative one): e4m3fn has no inf, so NaN (S.1111.111);
# e5m2 overflows to inf (S.11111.00). A NaN input is stored as S.1111.111 / S.11111.11 either way
# (positive: a NaN has no order to tell its sign by).
OVERFLOW_BYTE = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7C}
NAN_BYTE = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7F}
_KV_DTYPE_OF = {dtype: name for name, dtype in FP8_DTYPES.items()}
# The bits that, all set, make a code non-finite (the sign bit aside), and the largest magnitude code that is not NaN
# (e4m3fn: 448; e5m2: inf).
_NONFINITE_BITS = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7C}
_LAST_NOT_NAN = {"fp8_e4m3": 0x7E, "fp8_e5m2": 0x7C}
# Per dtype, a same-width integer view and its exponent bits, all set in a NaN or ±inf and nowhere else
_EXPONENT_BITS = {**{dtype: (torch.uint8, _NONFINITE_BITS[name]) for name, dtype in FP8_DTYPES.items()},
                  torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                  torch.float32: (torch.int32, 0x7F800000)}


def canonical_cache_dtype(name: str) -> str:
    """The cache dtype name fp8kv uses for `name` ("fp8" is vLLM's spelling of "fp8_e4m3")."""
    name = ALIASES.get(name, name)
    if name not in CACHE_DTYPES:
        choices = ", ".join([*CACHE_DTYPES, *ALIASES])
        raise Fp8kvError(f"unknown KV-cache dtype {name!r}; choose one of {choices}")
    return name


def cache_dtype(name: str) -> torch.dtype:
    """The torch dtype of a cache dtype name ("fp8_e4m3" or "fp8", "fp8_e5m2", "bf16", "fp32")."""
    return CACHE_DTYPES[canonical_cache_dtype(name)]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the fp8 cache dtypes."""
    return dtype in FP8_DTYPES.values()


def to_fp8(y: torch.Tensor, dtype: torch.dtype, *, saturate: bool) -> torch.Tensor:
    """`y` (already divided by the scale) as fp8 `dtype`, with out-of-range values handled here.

    saturate=True is a saturating conversion (CUDA's `__NV_SATFINITE`, or a clamp to ±MAX before the
    cast): ±MAX past the range, inf included. saturate=False is a plain conversion: values up to
    `RAW_CAST_FINITE_LIMIT` round to ±MAX, larger ones become NaN (e4m3fn) or ±inf (e5m2). NaN stays
    NaN in both. torch's cast sees only values within ±MAX and NaN, whose bytes are set here, so the bytes
    do not depend on whether the installed torch's cast saturates (torch >= 2.12, e4m3) or not (torch 2.9).
    """
    kv = _KV_DTYPE_OF[dtype]
    limit = FP8_MAX[kv]
    in_range = y.clamp(-limit, limit).to(dtype)  # ±inf to ±MAX
    nan = y.isnan()
    nan_up, over_up, nan_down, over_down = _special_values(kv, y.device)
    if saturate:  # NaN is all that is left, stored positive (a NaN has no order to tell its sign by)
        return torch.where(nan, nan_up, in_range)
    special = nan | (y.float().abs() > RAW_CAST_FINITE_LIMIT[kv])  # in float32: exact limit
    byte = torch.where(nan, nan_up, over_up)  # NaN, else the overflow value (a positive y)
    byte = torch.where(y < 0, torch.where(nan, nan_down, over_down), byte)  # not signbit: no XLA lowering
    return torch.where(special, byte, in_range)


@functools.cache
def _special_values(kv: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """+NaN, +overflow, -NaN, -overflow as one-element fp8 tensors on `device`, made from their bytes.

    Each is copied to the device on its own: a slice of one device tensor would be a pending XLA
    computation, and a graph that computes it once and reads it afterwards compiles twice.
    """
    bytes_ = [NAN_BYTE[kv], OVERFLOW_BYTE[kv], NAN_BYTE[kv] | 0x80, OVERFLOW_BYTE[kv] | 0x80]
    return tuple(torch.tensor([b], dtype=torch.uint8).view(FP8_DTYPES[kv]).to(device) for b in bytes_)


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Where `x` holds NaN or ±inf, read from its bits off XLA: every exponent bit set (e4m3fn's one such code with
    every mantissa bit set is its NaN; e5m2's are inf and NaN). torch's isfinite is several times slower on a CPU
    (a SmolLM2 prefill layer's K and V: 1.0 against 0.27 ms in bf16, 0.93 against 0.35 ms in float32), and would
    first widen an fp8 tensor to float32. XLA views no tensor's bits without a trip through the host."""
    bits = _EXPONENT_BITS.get(x.dtype)
    if bits is None or x.device.type == "xla":
        return ~torch.isfinite(x.float())
    view, exponent = bits
    return (x.view(view) & exponent) == exponent


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` as float32 in new memory of its own. fp8 on a CPU is read from a table of its 256 codes: torch converts
    fp8 there one value at a time, two to three times slower (a SmolLM2 prefill layer's K: 0.78 against 0.26 ms on
    2 cores), the same bits."""
    if not is_fp8(x.dtype) or x.device.type != "cpu":
        return x.to(torch.float32, copy=True)
    return torch.take(_float32_codes(x.dtype), x.view(torch.uint8).long())


@functools.cache
def _float32_codes(dtype: torch.dtype) -> torch.Tensor:
    """Every code of fp8 `dtype` as float32, at the index of its byte."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def reads_differently(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where two tensors of one dtype hold values that read differently: a NaN reads as any NaN, -0 as +0. fp8
    off XLA compares canonical bytes (every NaN one code, every zero one code), for the reason `nonfinite` gives."""
    if not is_fp8(a.dtype) or a.device.type == "xla":
        wide_a, wide_b = a.float(), b.float()
        return (wide_a != wide_b) & ~(wide_a.isnan() & wide_b.isnan())
    bytes_a, bytes_b = a.view(torch.uint8), b.view(torch.uint8)
    differ = bytes_a != bytes_b
    # only codes that differ can still read alike, and two writes of the same values differ in few of them
    at = differ.nonzero(as_tuple=True)
    differ[at] = _canonical_code(bytes_a[at].view(a.dtype)) != _canonical_code(bytes_b[at].view(b.dtype))
    return differ


def _canonical_code(x: torch.Tensor) -> torch.Tensor:
    code = x.view(torch.uint8)
    magnitude = code & 0x7F
    code = torch.where(magnitude > _LAST_NOT_NAN[_KV_DTYPE_OF[x.dtype]], 0x7F, code)
    return torch.where(magnitude == 0, 0, code)


def truncate_to_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`y` as fp8 `dtype` by vLLM's CPU conversion: clamped to ±MAX, then rounded toward zero.

    The CPU kernel keeps the top mantissa bits of the float32 value and drops the rest, so every stored
    magnitude is at most the true one (up to one fp8 step below it, where rounding to nearest errs by at
    most half a step). Its clamp is `max(-MAX, min(MAX, v))`, which turns NaN into +MAX; a zero of either
    sign is stored as +0. For e4m3 it first multiplies by 2**-120, which lands values below 2**-6 in float32's
    subnormal range: that product rounds to the nearest multiple of 2**-29 before the bits are cut.
    """
    kv = _KV_DTYPE_OF[dtype]
    limit = FP8_MAX[kv]
    y = y.float().nan_to_num(limit, limit, -limit).clamp(-limit, limit)
    if kv == "fp8_e4m3":  # at or above 2**-6 a float32 is a multiple of 2**-29 already: rounding keeps it
        y = torch.round(y * 2.0**29) * 2.0**-29
    nearest = y.to(dtype)  # within ±MAX: every torch's cast rounds to nearest even here
    code = nearest.view(torch.uint8)
    # rounded away from zero: the next code toward zero (fp8 codes grow with the magnitude)
    away = (nearest.float().abs() > y.abs()).to(torch.uint8)
    code = (code & 0x80) | ((code & 0x7F) - away)
    return torch.where(y == 0, torch.zeros_like(code), code).view(dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """`fp8(clamp(x / scale))` divided in float32 and saturated; other dtypes store `x` unscaled.

    The write every engine should do (vLLM's CUDA and TPU paths do exactly this); `fp8kv.engine_models`
    states each engine's own.
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    return to_fp8(x.float() / scale, dtype, saturate=True)
