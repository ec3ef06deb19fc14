"""On CPU the runtime's 16-bit linear layers sum in float32 and round once, a GPU's bf16 GEMM: through float32 where
the CPU has no fast 16-bit kernel, through PyTorch's where it has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8kv.checkpoint.load import load_language_model
from fp8kv.runtime.linear import Float32SumLinear, sum_linears_in_float32
from fp8kv.runtime.runner import load_model
from fp8kv.tools.factory import make_checkpoint


def _one_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of `x.dtype`'s values around each element of `x`."""
    exponent = torch.frexp(x.double().abs().clamp_min(torch.finfo(x.dtype).tiny))[1]
    return torch.finfo(x.dtype).eps * torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 1)


@pytest.mark.parametrize("rows", [1, 64])  # a decode step's row keeps PyTorch's kernel, a prefill's go through float32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_a_16_bit_linear_is_its_exact_sum_rounded_once(dtype, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 1536, bias=True).to(dtype)
    x = torch.randn(rows, 576).to(dtype)
    native = layer(x)
    sum_linears_in_float32(layer, fast=lambda dtype: False)
    assert type(layer) is Float32SumLinear
    ours = layer(x)
    assert ours.dtype == dtype
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    rounded_once = exact.to(dtype)
    # A float32 sum rounded once is the exact sum rounded, except where float32's own error of the sum (about
    # 2^-24 of the summed magnitudes per addition, 24 taken here) crosses a rounding boundary: there one step
    # off, or that error off where the sum cancels to near zero. A 16-bit accumulation misses by many steps.
    assert (ours != rounded_once).float().mean() < 5e-3
    float32_error = 24 * 2.0**-24 * F.linear(x.double().abs(), layer.weight.double().abs(), layer.bias.double().abs())
    assert ((ours.double() - rounded_once.double()).abs() <= _one_step(rounded_once) + float32_error).all()
    # PyTorch's own CPU kernel also sums in float32: only the order of the sums may differ.
    assert (ours != native).float().mean() < 5e-3


def test_float32_layers_and_subclasses_keep_their_forward():
    class QuantizedLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), QuantizedLinear(4, 4).to(torch.bfloat16))
    sum_linears_in_float32(model, fast=lambda dtype: False)
    assert [type(m) for m in model] == [torch.nn.Linear, QuantizedLinear]


def test_a_cpu_with_a_fast_16_bit_kernel_keeps_it_for_that_dtype_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4).to(torch.float16))
    sum_linears_in_float32(model, fast=lambda dtype: dtype == torch.bfloat16)
    assert [type(m) for m in model] == [torch.nn.Linear, Float32SumLinear]


def test_the_cpu_runtime_sums_a_bf16_checkpoint_in_float32_with_its_own_weights(tmp_path, monkeypatch):
    from fp8kv.runtime import linear

    model_dir = make_checkpoint("qwen3", tmp_path / "qwen3", dtype=torch.bfloat16)
    source = load_language_model(model_dir, torch.device("cpu"), "auto")
    fast = load_model(model_dir, torch.device("cpu"))
    expected = torch.nn.Linear if linear.has_16_bit_kernel(torch.bfloat16) else Float32SumLinear
    assert {type(m) for m in fast.modules() if isinstance(m, torch.nn.Linear)} == {expected}
    monkeypatch.setattr(linear, "has_16_bit_kernel", lambda dtype: False)  # a CPU without one
    runtime = load_model(model_dir, torch.device("cpu"))
    linears = [m for m in runtime.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Float32SumLinear for m in linears)
    theirs = source.state_dict()
    ours = runtime.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].dtype == torch.bfloat16 for name in ours)
