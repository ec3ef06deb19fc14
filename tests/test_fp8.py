"""The fp8 facts every stage imports: MAX, the plain cast's limits, and the engines' cast models."""

from __future__ import annotations

import pytest
import torch

from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import ENGINES, FP8_DTYPES, canonical_cache_dtype, quantize
from fp8kv.kvdtypes import FP8_MAX, RAW_CAST_FINITE_LIMIT


@pytest.mark.parametrize("name", sorted(FP8_DTYPES))
def test_raw_cast_limit_is_the_last_finite_value(name):
    dtype = FP8_DTYPES[name]
    limit = torch.tensor(RAW_CAST_FINITE_LIMIT[name])
    above = limit.nextafter(torch.tensor(float("inf")))
    assert limit.to(dtype).float().item() == FP8_MAX[name]
    assert not above.to(dtype).float().isfinite().item()


def test_fp8_max_and_vllm_spelling():
    assert FP8_MAX == {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
    assert canonical_cache_dtype("fp8") == "fp8_e4m3"


def test_engines_cast_the_same_value_differently():
    scale = torch.tensor(3.625 / 464.5)
    x = torch.tensor([464.5, 470.0, -1000.0, 100.0]) * scale  # bf16 rounds 464.5 to 464, a finite cast
    out = {engine: quantize(x, scale, torch.float8_e4m3fn, engine).float() for engine in ENGINES}
    assert out["clamp"].tolist() == [448.0, 448.0, -448.0, 96.0]
    assert out["raw"][:3].isnan().all() and out["raw"][3] == 96.0
    assert out["raw-bf16"][0] == 448.0 and out["raw-bf16"][1:3].isnan().all()  # divided in bf16 first


def test_unknown_engine_is_refused():
    with pytest.raises(Fp8kvError, match="unknown engine cast model 'saturate'; choose one of clamp, raw, raw-bf16"):
        quantize(torch.ones(1), torch.tensor(1.0), torch.float8_e4m3fn, "saturate")
