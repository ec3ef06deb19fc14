"""The engine models write what the engines' own conversion code writes, for every bf16 and fp16 value.

tests/engine_writes.cpp runs the CUDA engines' writes through NVIDIA's cuda_fp8.hpp and PyTorch's c10
headers (from the nvidia-cuda-* and torch packages in the venv), compiled for the host; tpu-inference's
write runs as its JAX expression on the CPU. Every bf16 and fp16 value but NaN is written at scales
chosen to land values on and past the fp8 maximum, and random float32 activations stand in for a
float32 model; the bytes must equal the engine models' under both torch casts (NaN past the range, as
before torch 2.12, and saturating, as from 2.12).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8kv.engine_models import activation_divide, engine_model
from fp8kv.fp8 import FP8_DTYPES, to_fp8
from tests.vendor_headers import build

SOURCE = Path(__file__).with_name("engine_writes.cpp")
# Scales that put bf16 values on the fp8 maxima and their rounding midpoints (448, 464, 57344, 61440), and a
# few that are not exact in bf16 (the engines that divide in bf16 round them first).
SCALES = (1.0, 0.5017, 0.0123, 2.0**-7, 3.3, 1e-3, 0.04321, 7.77e-5, 0.2, 1.9e-2)
E4M3, E5M2 = FP8_DTYPES["fp8_e4m3"], FP8_DTYPES["fp8_e5m2"]
# The writes engine_writes.cpp emits per scale, in order, for each activation dtype (its MODE): (engine, cache
# dtype). The TensorRT-LLM write is emitted for 16-bit activations.
# SGLang on c10's own conversion without a clamp: the releases pinning torch 2.11 or older (the c10 headers compiled
# here are torch 2.9's, whose conversion is 2.11's)
_WRITES = (("vllm-cuda", E4M3), ("vllm-cuda", E5M2), ("sglang@0.5.17", E4M3), ("sglang@0.5.17", E5M2))
WRITES = {"bf16": (*_WRITES, ("tensorrt-llm", E4M3)), "f16": (*_WRITES, ("tensorrt-llm", E4M3)), "f32": _WRITES}


@pytest.fixture(scope="module")
def engine_writes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(SOURCE, tmp_path_factory.mktemp("vendor") / "engine_writes")


def _vendor_bytes(binary: Path, mode: str, inputs: torch.Tensor, folder: Path) -> np.ndarray:
    """[scale, write, input] bytes from engine_writes.cpp."""
    (folder / "inputs").write_bytes(inputs.float().numpy().tobytes())
    subprocess.run([str(binary), mode, str(folder / "inputs"), str(folder / "out"), *map(repr, SCALES)], check=True)
    return np.fromfile(folder / "out", dtype=np.uint8).reshape(len(SCALES), len(WRITES[mode]), len(inputs))


def _every(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 16-bit float dtype but NaN, infinities included."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[~values.isnan()]


def _float32_activations() -> torch.Tensor:
    """Random float32 values from 1e-12 to 1e6 in magnitude, both signs, and the scaled fp8 limits."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** (torch.rand(200_000, generator=generator) * 18 - 12)
    signs = torch.where(torch.rand(200_000, generator=generator) < 0.5, -1.0, 1.0)
    limits = torch.tensor([448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0])
    near = torch.cat([limits * s * f for s in SCALES for f in (0.999999, 1.0, 1.000001)])
    return torch.cat([magnitudes * signs, near, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])


def _assert_same(expected: np.ndarray, got: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Equal bytes, where a NaN equals a NaN of any sign (c10 keeps the input's sign; fp8kv writes +NaN or -NaN
    by the sign of the value it failed to represent, which is the same sign)."""
    got_bytes = got.view(torch.uint8).numpy()
    nan = torch.from_numpy(expected.copy()).view(dtype).float().isnan().numpy() & got.float().isnan().numpy()
    differ = (expected != got_bytes) & ~nan
    assert not differ.any(), f"{what}: {differ.sum()} of {differ.size} bytes differ, first at input #{differ.argmax()}"


@pytest.mark.parametrize("mode", ["bf16", "f16", "f32"])
def test_cuda_engines_write_what_nvidias_and_torchs_conversions_write(engine_writes, mode, cast, tmp_path):
    inputs = {"bf16": lambda: _every(torch.bfloat16), "f16": lambda: _every(torch.float16),
              "f32": _float32_activations}[mode]()
    expected = _vendor_bytes(engine_writes, mode, inputs, tmp_path)
    for i, scale in enumerate(SCALES):
        for j, (name, dtype) in enumerate(WRITES[mode]):
            got = engine_model(name).write(inputs, torch.tensor(scale), dtype)
            _assert_same(expected[i, j], got, dtype, f"{name} {mode} -> {dtype} at scale {scale}")


def test_a_bf16_division_writes_what_tpu_inferences_jax_expression_writes_on_the_cpu(cast, monkeypatch):
    """On JAX's CPU backend tpu-inference's write divides in bf16, as SGLang's torch division does; compiled for a
    TPU it multiplies by a reciprocal instead (tests/test_engine_releases.py checks that program's bytes)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # libtpu is installed: without this, jax looks for a TPU first
    import jax.numpy as jnp
    import ml_dtypes

    inputs = _every(torch.bfloat16)
    tensor = jnp.asarray(inputs.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    finfo = jnp.finfo(jnp.float8_e4m3fn)
    for scale in SCALES:
        # static_per_tensor_quantize_tensor, with the Python float layer._k_scale_float as the scale
        stored = jnp.clip(tensor / scale, float(finfo.min), float(finfo.max)).astype(jnp.float8_e4m3fn)
        expected = np.asarray(stored).view(np.uint8)
        got = to_fp8(activation_divide(inputs, torch.tensor(scale)), E4M3, saturate=True)
        _assert_same(expected, got, E4M3, f"a bf16 division at scale {scale}")
