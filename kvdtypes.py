"""The fp8 KV-cache dtypes as names and numbers, without torch: MAX, a plain cast's limit, how files and
engines spell them; and NVFP4's numbers. `fp8.py` and `nvfp4.py` add the torch dtypes and the casts; reports and
the card read these."""

from __future__ import annotations

from typing import get_args

from fp8kv.options import KV_DTYPE_SPELLINGS, KvDtype, Nvfp4KvDtype, Nvfp4Write

KV_DTYPES: tuple[str, ...] = get_args(KvDtype)
NVFP4_KV_DTYPES: tuple[str, ...] = get_args(Nvfp4KvDtype)
NVFP4_WRITES: tuple[str, ...] = get_args(Nvfp4Write)
# The largest finite value of each dtype (torch.finfo(torch.float8_e4m3fn).max, ...; fp8.py checks them).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# The |x| (in units of the stored scale) that a calibrated amax maps to, per kv dtype: MAX for fp8; for NVFP4 the
# e4m3 maximum of the block scales, as ModelOpt exports a global scale since 0.42 (amax / 448), which no engine
# path fp8kv knows overflows (checkpoint/nvfp4.py has the conventions, docs/nvfp4.md why).
SCALE_BOUND = FP8_MAX | dict.fromkeys(NVFP4_KV_DTYPES, FP8_MAX["fp8_e4m3"])
# The torch dtype name engines print for each kv dtype (the vLLM JSON file stores it).
TORCH_DTYPE_NAME = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# A kv dtype as checkpoint files name it: the torch name ("float8_e4m3fn") or fp8kv's ("fp8_e4m3").
_KV_DTYPE_BY_FILE_NAME = {torch_name: kv for kv, torch_name in TORCH_DTYPE_NAME.items()} | {kv: kv for kv in KV_DTYPES}
# What `--kv-cache-dtype` takes for each kv dtype: vLLM spells e4m3 "fp8", SGLang uses fp8kv's names.
VLLM_KV_CACHE_DTYPE = {kv: next((s for s, name in KV_DTYPE_SPELLINGS.items() if name == kv), kv) for kv in KV_DTYPES}

# The largest |x / scale| a plain (non-saturating) cast still turns into a finite value.
# e4m3fn: 448 < y <= 464 rounds down to 448, anything above is NaN (e4m3fn has no inf).
# e5m2: y rounds to 57344 below 61440 (halfway to 2**16) and to inf from 61440 on.
RAW_CAST_FINITE_LIMIT = {"fp8_e4m3": 464.0, "fp8_e5m2": 61439.99609375}  # float32 just below 61440

# NVFP4: 4-bit e2m1 values (1 sign, 2 exponent bits with bias 1, 1 mantissa bit; no inf or NaN), one e4m3 scale per
# block of NVFP4_BLOCK_SIZE consecutive head_dim values, one float32 scale per layer and side (the checkpoint's k_scale).
# E2M1_MAGNITUDES[c] is the magnitude of code c (0..7; bit 3 is the sign); code 1 is e2m1's one subnormal.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = E2M1_MAGNITUDES[-1]
NVFP4_BLOCK_SIZE = 16
NVFP4_BLOCK_SCALE_DTYPE = "fp8_e4m3"


def kv_dtype_from_file(name: str) -> str | None:
    """The fp8 kv dtype a checkpoint file names ("float8_e4m3fn" or "fp8_e4m3"); None when it is no fp8 dtype."""
    return _KV_DTYPE_BY_FILE_NAME.get(name)
