"""What of SGLang's NVFP4 KV-cache write and read runs on a CPU, run there, for tests/test_nvfp4_sglang.py.

A standalone script for SGLang's python (the venv probes/sglang_venv.sh builds; stdlib, torch, sglang):

    bench/.sglang-venv/bin/python probes/sglang_nvfp4_write.py [--out FILE]

SGLang 0.5.23's pool (`mem_cache/memory_pool.py`, `_set_quantized_kv_buffer`) hands K and V to
`NVFP4KVCacheMethod.quantize_and_store`, which quantizes with `NVFP4KVQuantizeUtil.quantize` (`kvfp4_tensor.py`:
FlashInfer's `nvfp4_kv_quantize` on sm100 and sm120, a CUDA kernel) and scatters the bytes with a Triton kernel
(`nvfp4_kv_cache.py`). Neither runs on a CPU; the probe records the quantize's refusal under each GPU generation's
`override_platform`. What does run:

- `nvfp4_v_scale_swizzle_indices` (`nvfp4_kv_cache.py`), the torch statement of the four-token V-scale interleave the
  Triton store writes for sm100's trtllm-gen: each (token, block) of a page's linear scales, and where it goes.
- `NVFP4KVQuantizeUtil.dequantize`'s pure-torch branch (taken when the platform answers sm90 only), which forms
  `(e2m1 * block scale) * global scale` in float32 and rounds it to bf16, the arithmetic of FlashInfer's CUDA
  `nvfp4_kv_dequantize` that sm100 and sm120 call (`data/csrc/fp4_kv_dequantization.cu`, read). Its block scales
  broadcast against one row only (`[1, 1, n / 16]`; more rows or heads fail, recorded), so it runs one row: every
  packed code byte and every non-NaN e4m3 block-scale byte, at a few global scales.

The file hashes pin the sources this reading and the docs' comparison with vLLM's write come from.
"""

from __future__ import annotations

import argparse
import hashlib
import struct
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from outputs import emit_json  # noqa: E402  (probes/outputs.py, beside this script)

GPUS = {"sm100": {"is_sm100": True}, "sm120": {"is_sm100": False, "is_sm120": True}}
SM90 = {"is_sm100": False, "is_sm120": False, "is_sm90": True}  # the platform the pure-torch dequantize needs
PAGE_SIZES = (4, 8, 16)
SCALE_DIMS = (4, 8, 16)  # head_dim 64, 128, 256
CALIBRATED = 0.0123  # a calibrated-looking amax / 448
SAMPLE_EVERY = 61  # the explicit bf16 entries the golden file keeps beside each hash
SOURCES = {"sglang": ("srt/mem_cache/memory_pool.py", "srt/layers/quantization/fp4_kv_cache_quant_method.py",
                      "srt/layers/quantization/kvfp4_tensor.py", "srt/layers/quantization/nvfp4_kv_cache.py"),
           "flashinfer": ("quantization/fp4_quantization.py", "data/csrc/fp4_kv_quantization.cu",
                          "data/csrc/fp4_kv_dequantization.cu")}


def _float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


# 1.0 (no calibrated scale, where every product is exact), CALIBRATED, the value SGLang's sm100 loader holds for it
# (the float32 stored value times 6.0, back in float32), and 1/448
GLOBAL_SCALES = (1.0, _float32(CALIBRATED), _float32(_float32(CALIBRATED) * 6.0), _float32(1 / 448))


def _sources() -> dict[str, str]:
    import flashinfer
    import sglang

    roots = {"sglang": Path(sglang.__file__).parent, "flashinfer": Path(flashinfer.__file__).parent}
    return {f"{package}/{path}": hashlib.sha256((roots[package] / path).read_bytes()).hexdigest()
            for package, paths in SOURCES.items() for path in paths}


def _quantize_refusals() -> dict[str, str]:
    import torch
    from sglang.srt.layers.quantization.kvfp4_tensor import NVFP4KVQuantizeUtil
    from sglang.srt.runtime_context import override_platform

    refused = {}
    for gpu, facts in GPUS.items():
        with override_platform(**facts):
            try:
                NVFP4KVQuantizeUtil.quantize(torch.ones(1, 1, 16, dtype=torch.bfloat16), torch.ones(1))
            except (ValueError, RuntimeError) as error:
                refused[gpu] = f"{type(error).__name__}: {error}"
            else:
                raise SystemExit(f"NVFP4KVQuantizeUtil.quantize ran on a CPU as {gpu}: record its bytes instead")
    return refused


def _swizzles() -> list[dict[str, Any]]:
    import torch
    from sglang.srt.layers.quantization.nvfp4_kv_cache import nvfp4_v_scale_swizzle_indices

    out = []
    for page_size in PAGE_SIZES:
        for scale_dim in SCALE_DIMS:
            tokens = torch.arange(page_size)[:, None].expand(page_size, scale_dim)
            blocks = torch.arange(scale_dim)[None, :].expand(page_size, scale_dim)
            row, column = nvfp4_v_scale_swizzle_indices(tokens, blocks, scale_dim)
            # position in the page's [page_size, scale_dim] scales of (token t, block s), row-major over (t, s)
            out.append({"page_size": page_size, "scale_dim": scale_dim,
                        "positions": (row * scale_dim + column).flatten().tolist()})
    return out


def _dequantize() -> dict[str, Any]:
    import torch
    from sglang.srt.layers.quantization.kvfp4_tensor import NVFP4KVQuantizeUtil
    from sglang.srt.runtime_context import override_platform

    scale_bytes = bytes(b for b in range(256) if b & 0x7F != 0x7F)  # every e4m3 byte but the two NaNs
    blocks = len(scale_bytes)
    code_bytes = bytes((7 * i) % 256 for i in range(blocks * 8))  # 8 packed bytes a block; 7 is odd: every byte
    codes = torch.tensor(list(code_bytes), dtype=torch.uint8).view(1, 1, -1)
    scales = torch.tensor(list(scale_bytes), dtype=torch.uint8).view(1, 1, -1).view(torch.float8_e4m3fn)
    reads = []
    with override_platform(**SM90):
        for value in GLOBAL_SCALES:
            s = torch.tensor([value], dtype=torch.float32)
            out = NVFP4KVQuantizeUtil.dequantize(codes, scales, s).flatten()
            bits = (out.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
            reads.append({"global_scale": value, "dtype": str(out.dtype),
                          "bf16_sha256": hashlib.sha256(struct.pack(f"<{len(bits)}H", *bits)).hexdigest(),
                          "samples": {str(i): f"{bits[i]:04x}" for i in range(0, len(bits), SAMPLE_EVERY)}})
        try:  # two heads of one token: the block scales' [1, 2, n / 16, 1] does not broadcast against [1, 2n / 16, 16]
            NVFP4KVQuantizeUtil.dequantize(codes.view(1, 2, -1), scales.view(1, 2, -1), torch.ones(1))
        except RuntimeError as error:
            more_rows = f"{type(error).__name__}: {error}"
        else:
            raise SystemExit("the pure-torch dequantize ran on two heads: record them too")
    return {"code_bytes": code_bytes.hex(), "block_scale_bytes": scale_bytes.hex(), "reads": reads,
            "two_heads_refused": more_rows, "sample_every": SAMPLE_EVERY}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    args = options.parse_args()
    import flashinfer
    import sglang
    import torch

    out = {"probe": "probes/sglang_nvfp4_write.py", "how": "run", "engine": "sglang",
           "meta": {"sglang": sglang.__version__, "flashinfer": flashinfer.__version__, "torch": torch.__version__},
           "sources_sha256": _sources(), "quantize_on_cpu": _quantize_refusals(), "v_scale_swizzle": _swizzles(),
           "dequantize": _dequantize()}
    emit_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
