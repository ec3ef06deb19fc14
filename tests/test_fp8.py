"""The fp8 facts every stage imports: MAX, the plain cast's limits, and fp8kv's own cast.

The expected bytes are written out, and the same bytes must come back when torch's cast saturates
(torch >= 2.12 on CPU; emulated here): fp8kv decides every out-of-range value itself.
"""

from __future__ import annotations

import pytest
import torch

from fp8kv.fp8 import FP8_DTYPES, canonical_cache_dtype, to_fp8
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


def bytes_of(stored: torch.Tensor) -> list[int]:
    return stored.view(torch.uint8).tolist()


@pytest.mark.parametrize("saturate", [True, False])
def test_out_of_range_bytes_do_not_depend_on_torchs_cast(cast, saturate):
    plain = bytes_of(torch.tensor([1000.0]).to(E4M3))
    assert plain == ([0x7E] if cast == "saturating torch" else [0x7F])  # the two torches differ here
    assert bytes_of(to_fp8(torch.tensor(INPUTS), E4M3, saturate=saturate)) == E4M3_BYTES[saturate]
    assert bytes_of(to_fp8(torch.tensor(E5M2_INPUTS), E5M2, saturate=saturate)) == E5M2_BYTES[saturate]


def test_a_bf16_input_is_judged_by_its_own_value(cast):
    y = torch.tensor([464.0, 466.0, 61440.0], dtype=torch.bfloat16)  # 466 is bf16-representable
    assert bytes_of(to_fp8(y[:2], E4M3, saturate=False)) == [0x7E, 0x7F]
    assert bytes_of(to_fp8(y[2:], E5M2, saturate=False)) == [0x7C]


def test_fp8_max_and_vllm_spelling():
    assert FP8_MAX == {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
    assert set(FP8_DTYPES.values()) == {E4M3, E5M2}
    assert canonical_cache_dtype("fp8") == "fp8_e4m3"
