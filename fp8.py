"""FP8 facts in one place: cache dtype names, MAX, what a plain cast does past MAX, and how engines cast.

A KV scale is a dequantization multiplier: an engine stores `fp8(x / scale)` and reads
`float(stored) * scale`. How it turns `x / scale` into fp8 differs between engines, and only a
saturating conversion is safe: torch's cast (torch 2.9, CPU and XLA) does not saturate.
"""

from __future__ import annotations

from typing import get_args

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import FP8_MAX, TORCH_DTYPE_NAME
from fp8kv.options import KV_DTYPE_SPELLINGS, EngineName

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CACHE_DTYPES = {**FP8_DTYPES, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = KV_DTYPE_SPELLINGS
assert all(torch.finfo(dtype).max == FP8_MAX[name] and str(dtype) == f"torch.{TORCH_DTYPE_NAME[name]}"
           for name, dtype in FP8_DTYPES.items()), "kvdtypes.py disagrees with torch"

# How an engine turns `x / scale` into fp8 (chosen with `fp8kv verify --engine`):
#   clamp     divide in float32, clamp to ±MAX, cast (vLLM CUDA's saturating conversion, vLLM's TPU
#             Pallas write path; tpu-inference clips too).
#   raw       divide in float32, plain cast: NaN (e4m3) or inf (e5m2) past the limits above.
#   raw-bf16  divide the bf16 tensor in bf16, then a plain cast (engines that divide the cached
#             tensor in place, such as SGLang's `cache_k.div_(k_scale)`).
ENGINES: tuple[str, ...] = get_args(EngineName)
# What each engine model stands for, as reports name it.
ENGINE_DESCRIPTIONS = {
    "clamp": "divide in float32, clamp to ±MAX, cast (vLLM CUDA and TPU)",
    "raw": "divide in float32, plain cast",
    "raw-bf16": "divide in bf16, plain cast, as in-place division of the bf16 tensor does (SGLang)",
}


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


def check_engine(engine: str) -> str:
    """`engine` if it is a known cast model, else a one-line error listing them."""
    if engine not in ENGINES:
        raise Fp8kvError(f"unknown engine cast model {engine!r}; choose one of {', '.join(ENGINES)}")
    return engine


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, engine: str = "clamp") -> torch.Tensor:
    """`x / scale` cast to the fp8 `dtype` the way `engine` casts it; other dtypes store `x` unscaled."""
    if not is_fp8(dtype):
        return x.to(dtype)
    check_engine(engine)
    if engine == "raw-bf16":
        return (x.to(torch.bfloat16) / scale).to(torch.bfloat16).to(dtype)
    y = x.float() / scale
    if engine == "clamp":
        limit = torch.finfo(dtype).max
        y = y.clamp(-limit, limit)
    return y.to(dtype)
