"""A 16-bit model's linear layers on CPU, computed as float32 products of the 16-bit values where that is faster.

A bf16 or fp16 GEMM on a GPU multiplies the 16-bit values exactly in float32, sums in float32 and
rounds the result once; PyTorch's own CPU kernel does the same (on SmolLM2's shapes 0.013 % of
outputs differ from the float32 route by one rounding, from the order of the sums, with the same
error against float64). Where oneDNN has no kernel for the dtype on this CPU (bf16 without AVX-512,
fp16 without AVX-512-FP16 or AMX-FP16), PyTorch's fallback is about 9x slower than a float32 GEMM of
the same shape (2 cores, AVX2: 0.245 s against 0.027 s for 2048 tokens through 576 -> 1536), and nearly
all of a CPU forward is linear layers: there the layers compute through float32, the same arithmetic at
float32's speed. Where oneDNN has one, it is the faster (AVX-512 with AVX512_BF16, same shape: 0.024 s
against 0.043 s), and the layers keep it. The float32 copy of a weight lives only for its own call, so the
model's memory stays its own. A call of a few rows (a decode step) keeps PyTorch's kernel, whose few-row
path sums in float32 too and is the faster one there: the float32 route would convert the whole weight for it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# Below this many rows PyTorch's 16-bit kernel is the faster (one row through 640 -> 262,144: 25 ms against
# 212 ms for the float32 route, whose weight conversion is most of it; at 8 rows the two are about even).
FLOAT32_ROWS = 8


class Float32SumLinear(torch.nn.Linear):
    """`nn.Linear` over 16-bit weights and inputs, summed in float32 and rounded once to the input's dtype.

    A product of two bf16 (8-bit significand) or fp16 (11-bit) values is exact in float32 (24-bit).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < FLOAT32_ROWS * x.shape[-1]:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def has_16_bit_kernel(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs PyTorch's CPU GEMM in `dtype` on this CPU (its own check of the CPU's flags)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return torch.backends.mkldnn.is_available() and bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without the check: assume the slow fallback
        return False


def cpu_kernels() -> dict[str, str | bool]:
    """The kernels that decide a bf16 model's results on this CPU: the vector width of torch's own (`AVX512`, `AVX2`,
    ...) and whether oneDNN runs bf16 GEMMs. `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` make an AVX-512 CPU
    compute as one without it."""
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16_gemm": has_16_bit_kernel(torch.bfloat16)}


def sum_linears_in_float32(model: torch.nn.Module, fast: Callable[[torch.dtype], bool] | None = None) -> None:
    """Make each plain `nn.Linear` of `model` with 16-bit weights a `Float32SumLinear`, in place (the same
    parameters and state dict), unless `fast` (default `has_16_bit_kernel`) says this CPU has a fast kernel for
    its dtype. Subclasses of `nn.Linear` (quantized layers) keep their own forward."""
    kept = {dtype: (fast or has_16_bit_kernel)(dtype) for dtype in SIXTEEN_BIT}
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in SIXTEEN_BIT and not kept[module.weight.dtype]:
            module.__class__ = Float32SumLinear
