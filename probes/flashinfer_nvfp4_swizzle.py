"""Where FlashInfer's own code puts each NVFP4 block scale of a paged K/V cache, recorded for tests/test_nvfp4_cache.py.

Runs in bench/.flashinfer-venv (probes/flashinfer_venv.sh: flashinfer-python 0.7.0.post1, the release vLLM 0.32.0
pins), imports nothing of fp8kv:

    bench/.flashinfer-venv/bin/python probes/flashinfer_nvfp4_swizzle.py --out tests/golden/nvfp4-flashinfer-0.7.0.post1.json

The function is `nvfp4_quantize_paged_kv_cache` (flashinfer/quantization/fp4_quantization.py), FlashInfer's
quantizer of a paged cache "for the trtllm-gen MHA kernel": it quantizes K and V with `fp4_quantize` asking for
linear block scales, keeps K's linear and swizzles V's in groups of 4 tokens with a torch reshape and permute, the
layout sm100's trtllm-gen kernels read and vLLM's CUDA write stores below compute capability 12.

`fp4_quantize` is a CUDA kernel FlashInfer compiles on first use; on a CPU tensor it stops at
`get_compute_capability` (the probe records the error). The swizzle after it is plain torch, so the probe runs the
function as shipped with `fp4_quantize` replaced by a stand-in that returns, for the linear layout FlashInfer asks
for, block-scale byte i = i: each byte of the returned K and V scales then names the linear block it came from.
The stand-in checks that FlashInfer asked for 16-value blocks in the linear layout, and each call is recorded. The
e2m1 codes and block-scale values themselves are not FlashInfer's here (vLLM's write makes them; its reference is
tests/golden/nvfp4-vllm-0.32.0.json). Only the HND layout is recorded: vLLM's page is HND.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from importlib import metadata
from pathlib import Path

import torch
from flashinfer.quantization import fp4_quantization

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outputs import write_json  # noqa: E402  (probes/outputs.py, beside this script)

BLOCK = 16
# (num_pages, kv_heads, page_size, head_dim): head_dim / 16 = 8, 16 and 4 block scales a token, at most 256 blocks a
# side, so a byte can name each one
GEOMETRIES = ((2, 2, 8, 128), (1, 2, 8, 256), (2, 1, 16, 64))
# page_size not a multiple of 4, head_dim not a multiple of 64: FlashInfer refuses the V swizzle
REFUSED = ((1, 1, 6, 64), (1, 1, 4, 32))


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


def _labelled_scales(calls: list[dict]):
    """The stand-in for `fp4_quantize`: zero codes, and linear block-scale byte i holding i."""

    def quantize(x: torch.Tensor, global_scale: torch.Tensor, sf_vec_size: int = BLOCK,
                 sf_use_ue8m0: bool = False, is_sf_swizzled_layout: bool = True, **rest) -> tuple:
        calls.append({"shape": list(x.shape), "sf_vec_size": sf_vec_size, "sf_use_ue8m0": sf_use_ue8m0,
                      "is_sf_swizzled_layout": is_sf_swizzled_layout, "other_arguments": sorted(rest)})
        if sf_vec_size != BLOCK or is_sf_swizzled_layout or sf_use_ue8m0:
            raise SystemExit(f"FlashInfer now asks fp4_quantize for {calls[-1]}: the stand-in returns linear e4m3 "
                             "scales of 16-value blocks only; read the new call before recording")
        rows, head_dim = x.shape
        blocks = rows * head_dim // BLOCK
        assert blocks <= 256, "a byte names at most 256 blocks"
        return (torch.zeros(rows, head_dim // 2, dtype=torch.uint8),
                torch.arange(blocks, dtype=torch.int32).to(torch.uint8).view(rows, head_dim // BLOCK))

    return quantize


def _cache(pages: int, heads: int, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.zeros(pages, heads, page_size, head_dim, dtype=torch.bfloat16)
    return k, k.clone()


def _run(geometry: tuple[int, int, int, int]) -> dict:
    pages, heads, page_size, head_dim = geometry
    one = torch.ones(1, dtype=torch.float32)
    _, (k_scales, v_scales), _, _ = fp4_quantization.nvfp4_quantize_paged_kv_cache(
        *_cache(*geometry), "HND", one, one)
    return {"kv_layout": "HND", "num_pages": pages, "kv_heads": heads, "page_size": page_size, "head_dim": head_dim,
            "shape": list(v_scales.shape), "k_scales": _hex(k_scales), "v_scales": _hex(v_scales)}


def _refusal(geometry: tuple[int, int, int, int]) -> dict:
    pages, heads, page_size, head_dim = geometry
    one = torch.ones(1, dtype=torch.float32)
    try:
        fp4_quantization.nvfp4_quantize_paged_kv_cache(*_cache(*geometry), "HND", one, one)
    except ValueError as error:
        return {"page_size": page_size, "head_dim": head_dim, "error": str(error)}
    raise SystemExit(f"FlashInfer now swizzles page_size {page_size}, head_dim {head_dim}: read it before recording")


def _kernel_on_cpu() -> str:
    """What the shipped `fp4_quantize` says to a CPU tensor, before the stand-in replaces it."""
    one = torch.ones(1, dtype=torch.float32)
    try:
        fp4_quantization.nvfp4_quantize_paged_kv_cache(*_cache(1, 1, 4, 64), "HND", one, one)
    except Exception as error:  # noqa: BLE001  (the error is the record)
        return f"{type(error).__name__}: {error}"
    raise SystemExit("fp4_quantize ran on a CPU tensor: record its output instead of a stand-in's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    module = Path(fp4_quantization.__file__)
    kernel_on_cpu = _kernel_on_cpu()
    calls: list[dict] = []
    fp4_quantization.fp4_quantize = _labelled_scales(calls)
    write_json(args.out, {
        "probe": "probes/flashinfer_nvfp4_swizzle.py",
        "how": "run",
        "engine": f"flashinfer-python {metadata.version('flashinfer-python')}",
        "module": "flashinfer/quantization/fp4_quantization.py",
        "function": "nvfp4_quantize_paged_kv_cache",
        "module_sha256": hashlib.sha256(module.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "fp4_quantize_on_cpu": kernel_on_cpu,
        "block_scale_bytes": "fp4_quantize replaced: linear block i's scale byte is i; each output byte names its block",
        "swizzled": [_run(geometry) for geometry in GEOMETRIES],
        "refused": [_refusal(geometry) for geometry in REFUSED],
        "fp4_quantize_calls": calls,
    })


if __name__ == "__main__":
    main()
