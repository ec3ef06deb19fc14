"""On a CUDA GPU: the engine models' fp8 writes against the GPU's own arithmetic, every bf16 and fp16 value.

- `vllm-cuda`: float32 division rounded to nearest, then the hardware's saturating conversion (a Triton
  kernel with `tl.math.div_rn`, whose fp8 store is `cvt.rn.satfinite` on sm89+, the instruction
  `__nv_cvt_float_to_fp8` is on those GPUs);
- `vllm-triton`: vLLM's Triton write as written, `x / tl.load(scale)` stored to an fp8 pointer (Triton's
  approximate float32 division, which the model computes exactly: mismatches are expected, counted here);
- `sglang`: `x.div_(scale)` with a 0-dim float32 CUDA scale, then `.to(fp8)`, on the machine's torch
  (SGLang pins torch 2.11.0: run it on that version to check SGLang's NaN).

Prints a table and writes $OUT/gpu_writes.json; exits 1 when vllm-cuda or sglang differ from their models.

    python probes/gpu_writes.py --out results/gpu_writes.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from fp8kv.engine_models import engine_model
from fp8kv.fp8 import FP8_DTYPES

SCALES = (1.0, 0.5017, 0.0123, 2.0**-7, 3.3, 1e-3, 0.04321, 7.77e-5, 0.2, 1.9e-2)
EXACT = ("vllm-cuda", "sglang")  # must match byte for byte; vllm-triton's division is approximate


@triton.jit
def _divide_and_store(x_ptr, scale_ptr, out_ptr, n, ROUNDED: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    scale = tl.load(scale_ptr)
    quotient = tl.math.div_rn(x, scale) if ROUNDED else x / scale
    tl.store(out_ptr + offsets, quotient, mask=mask)  # the implicit cast to the fp8 pointer's type


def _triton_write(x: torch.Tensor, scale: float, fp8: torch.dtype, rounded: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=fp8, device=x.device)
    scale_tensor = torch.tensor([scale], dtype=torch.float32, device=x.device)
    block = 1024
    _divide_and_store[(triton.cdiv(x.numel(), block),)](x, scale_tensor, out, x.numel(), ROUNDED=rounded, BLOCK=block)
    return out


def _torch_write(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    divided = x.clone()
    divided.div_(torch.tensor(scale, dtype=torch.float32, device=x.device))  # a 0-dim tensor on the device
    return divided.to(fp8)


def _every(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[~values.isnan()]


def _differences(gpu: torch.Tensor, model: torch.Tensor) -> int:
    """Bytes that differ, a NaN of either sign equal to a NaN."""
    gpu, model = gpu.cpu(), model.cpu()
    both_nan = gpu.float().isnan() & model.float().isnan()
    return int(((gpu.view(torch.uint8) != model.view(torch.uint8)) & ~both_nan).sum())


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--out", type=Path, default=Path("bench/results/gpu_writes.json"))
    options.add_argument("--device", default="cuda")
    args = options.parse_args()
    rows = []
    writes = {"vllm-cuda": lambda x, s, f: _triton_write(x, s, f, rounded=True),
              "vllm-triton": lambda x, s, f: _triton_write(x, s, f, rounded=False),
              "sglang": _torch_write}
    for activation in (torch.bfloat16, torch.float16):
        inputs = _every(activation)
        on_device = inputs.to(args.device)
        for kv, fp8 in FP8_DTYPES.items():
            for engine, write in writes.items():
                differ = sum(_differences(write(on_device, scale, fp8),
                                          engine_model(engine).write(inputs, torch.tensor(scale), fp8))
                             for scale in SCALES)
                rows.append({"engine": engine, "activation": str(activation).removeprefix("torch."), "cache": kv,
                             "values": len(inputs) * len(SCALES), "differ": differ})
    print(f"{'engine':12} {'activation':10} {'cache':9} {'values':>8} {'differ':>7}")
    for row in rows:
        print(f"{row['engine']:12} {row['activation']:10} {row['cache']:9} {row['values']:>8} {row['differ']:>7}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "scales": SCALES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    raise SystemExit(1 if any(r["differ"] for r in rows if r["engine"] in EXACT) else 0)


if __name__ == "__main__":
    main()
