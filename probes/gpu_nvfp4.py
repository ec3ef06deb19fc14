"""On a CUDA GPU: the NVFP4 cache write vLLM 0.32.0 runs on sm80/sm90/sm120, recorded byte for byte, and held
against fp8kv's write (runtime/nvfp4_cache.py), which models vLLM's own sm100 kernel.

On those GPUs vLLM's FlashInfer backend (v1/attention/backends/flashinfer.py, `nvfp4_fa2`) writes K/V with FlashInfer's
`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` into views of its HND page ([K codes | K block scales |
V codes | V block scales], both block scales linear). FlashInfer compiles that kernel on first use with its JIT's
flags (`-use_fast_math`: its divisions become approximate); here the same host launcher,
`flashinfer::NVFP4QuantizeAppendPagedKVCacheWithSlotMapping` of FlashInfer 0.7.0.post1's `include/flashinfer/page.cuh`
(copied from its wheel by gpu_nvfp4.sh --prepare), is built with those flags and called on the same views, without
FlashInfer's Python (whose imports need cutlass-dsl and cudnn, too large to carry).

Inputs are bf16 K/V rows whose 16-value blocks cover the hard cases (zero blocks, e2m1 ties, e4m3 block-scale ties,
saturated and subnormal block scales, bf16 subnormals, random blocks from 1e-6 to 1e2 for the approximate
reciprocals), written at unit and calibrated global scales. The recording holds the inputs and the pages as hex;
`compare` recomputes fp8kv's pages from it and counts the bytes that differ per region, on the GPU and in the tests.

    bash probes/gpu_nvfp4.sh                       # on the lent GPU: $OUT/nvfp4-flashinfer-write.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8kv.nvfp4 import E4M3
from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache

HEAD_DIM, KV_HEADS, PAGE_SIZE, TOKENS = 128, 2, 16, 128
NUM_PAGES = TOKENS // PAGE_SIZE + 1  # page 0 is fp8kv's scratch page: the tokens fill pages 1 and on
# (k_scale, v_scale): unit, where block maxima land exactly on the ties below, and two calibrated pairs
SCALES = ((1.0, 1.0), (0.0123, 0.04321), (2.0**-7, 0.5017))
# FlashInfer 0.7.0.post1's JIT flags (flashinfer/jit/core.py, gen_jit_spec) that can move a result
# (its -std=c++17 is left to torch, whose headers need C++20 since 2.10)
JIT_FLAGS = ("-use_fast_math", "-O3", "-DNDEBUG", "-DFLASHINFER_ENABLE_BF16",
             "-DFLASHINFER_ENABLE_FP8_E4M3")
HEADERS = ("page.cuh", "exception.h", "fastdiv.cuh", "layout.cuh", "utils.cuh", "vec_dtypes.cuh")
REGIONS = ("k_codes", "k_scales", "v_codes", "v_scales")


def _blocks(generator: torch.Generator) -> torch.Tensor:
    """Float32 16-value blocks, each exactly a bf16 value: the constructed hard cases, then random blocks."""
    e2m1 = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.5])
    rows = [torch.zeros(16), -torch.zeros(16), torch.full((16,), 1e-39)]  # zero, -0, bf16 subnormals
    rows += [e2m1 * 2.0**e for e in range(-12, 9)]  # at unit scale SF = 2**e exactly: every value an e2m1 tie
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3).float()
    for midpoint in ((e4m3[1:] + e4m3[:-1]) / 2 * 6):  # at unit scale the block maximum / 6 is an e4m3 midpoint
        if midpoint.bfloat16().float() == midpoint:
            rows.append(torch.cat([midpoint[None], torch.linspace(-1, 1, 15) * midpoint]))
    for bmax in (3000.0, 1e5, 3.0e38, 0.01, 0.05, 6 * 2.0**-10, 3 * 2.0**-10, 1e-4):  # saturated, subnormal, zeroed
        rows.append(torch.linspace(-1, 1, 16).roll(3) * bmax)
    magnitudes = 10.0 ** (torch.rand(len(rows) * 8, 1, generator=generator) * 8 - 6)
    rows += list(torch.randn(len(rows) * 8, 16, generator=generator) * magnitudes)
    return torch.stack(rows).bfloat16().float()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, bf16 `[TOKENS, KV_HEADS, HEAD_DIM]`: the blocks of `_blocks`, cycled, V's in another order."""
    generator = torch.Generator().manual_seed(0)
    blocks = _blocks(generator)
    per_side = TOKENS * KV_HEADS * HEAD_DIM // 16
    order = torch.arange(per_side) % len(blocks)
    k, v = (blocks[o].reshape(TOKENS, KV_HEADS, HEAD_DIM).bfloat16()
            for o in (order, order[torch.randperm(per_side, generator=generator)]))
    return k, v


def slots() -> torch.Tensor:
    return torch.arange(TOKENS) + PAGE_SIZE


def fa2_views(pages: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(K codes, V codes), (K scales, V scales) over `pages` uint8 `[NUM_PAGES, page bytes]`, HND, as vLLM's
    `_nvfp4_kv_views` lays each side out: its codes `[pages, heads, page_size, head_dim/2]`, then its scales."""
    codes, scales = KV_HEADS * PAGE_SIZE * HEAD_DIM // 2, KV_HEADS * PAGE_SIZE * HEAD_DIM // 16
    k, v = (pages[:, side * (codes + scales):][:, :codes + scales] for side in (0, 1))

    def split(side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (side[:, :codes].unflatten(1, (KV_HEADS, PAGE_SIZE, HEAD_DIM // 2)),
                side[:, codes:].unflatten(1, (KV_HEADS, PAGE_SIZE, HEAD_DIM // 16)).view(E4M3))

    (k_codes, k_sf), (v_codes, v_sf) = split(k), split(v)
    return (k_codes, v_codes), (k_sf, v_sf)


def fp8kv_pages(k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float, *, swizzle_v: bool) -> torch.Tensor:
    """fp8kv's write of `k`, `v` at `slots()`, laid out as vLLM's pages: uint8 `[NUM_PAGES - 1, page bytes]`."""
    cache = Nvfp4PagedKVCache([0], num_pages=NUM_PAGES, page_size=PAGE_SIZE, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, device=torch.device("cpu"), k_scales={0: k_scale},
                              v_scales={0: v_scale})
    cache.write(0, k, v, slots(), torch.ones(TOKENS, dtype=torch.bool))
    return torch.stack([cache.vllm_page(0, page, swizzle_v=swizzle_v) for page in range(1, NUM_PAGES)])


@dataclass(frozen=True)
class RegionDifference:
    """Bytes of one page region (`REGIONS`) where the recording and fp8kv differ, out of `total`; for codes also the
    4-bit values that differ (a byte holds two)."""

    region: str
    total: int
    bytes_differ: int
    nibbles_differ: int


@dataclass(frozen=True)
class RunDifference:
    k_scale: float
    v_scale: float
    regions: tuple[RegionDifference, ...]

    @property
    def differ(self) -> int:
        return sum(r.bytes_differ for r in self.regions)


def _regions(pages: torch.Tensor) -> dict[str, torch.Tensor]:
    (k_codes, v_codes), (k_sf, v_sf) = fa2_views(pages)
    return {name: t.contiguous().view(torch.uint8).flatten() for name, t in zip(REGIONS, (k_codes, k_sf, v_codes, v_sf))}


def _unhex(text: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8).view(dtype).reshape(shape)


def compare(recording: dict) -> list[RunDifference]:
    """Per recorded run, fp8kv's pages of the recorded inputs at its scales, in its layout, against the recorded
    pages: the bytes (and e2m1 nibbles) that differ, per region."""
    shape = (TOKENS, KV_HEADS, HEAD_DIM)
    k, v = (_unhex(recording["inputs"][side], torch.bfloat16, shape) for side in ("k", "v"))
    out = []
    for run in recording["runs"]:
        ours = _regions(fp8kv_pages(k, v, run["k_scale"], run["v_scale"], swizzle_v=recording["swizzled_v"]))
        theirs = _regions(_unhex(run["pages"], torch.uint8, (NUM_PAGES - 1, -1)))
        regions = []
        for name in REGIONS:
            a, b = ours[name], theirs[name]
            nibbles = (a & 0xF != b & 0xF).sum() + (a >> 4 != b >> 4).sum() if "codes" in name else (a != b).sum()
            regions.append(RegionDifference(name, a.numel(), int((a != b).sum()), int(nibbles)))
        out.append(RunDifference(run["k_scale"], run["v_scale"], tuple(regions)))
    return out


def print_differences(differences: list[RunDifference]) -> None:
    print(f"{'k_scale':>9} {'v_scale':>9} {'region':9} {'bytes':>6} {'differ':>7} {'values differ':>14}")
    for run in differences:
        for r in run.regions:
            print(f"{run.k_scale:>9.6g} {run.v_scale:>9.6g} {r.region:9} {r.total:>6} {r.bytes_differ:>7} "
                  f"{r.nibbles_differ:>14}")


# FlashInfer's page.cu binding, HND only: the strides it reads from each view (page, token, head), its launcher. The
# CUDA side includes no torch header (load_inline would add one; torch's pull in CUDA's CCCL, which FlashInfer's
# vendored one refuses to mix with); it runs on the default stream.
_LAUNCHER = r"""
#include <flashinfer/page.cuh>

int fa2_launch(void* k, void* v, int64_t* slots, const int64_t* sizes, const int64_t* strides, uint8_t* kc,
               uint8_t* vc, uint8_t* ksf, uint8_t* vsf, float* k_scale, float* v_scale) {
  const int64_t* s = strides;  // K, V inputs (token, head); K, V codes, K, V scales (page, token, head)
  return flashinfer::NVFP4QuantizeAppendPagedKVCacheWithSlotMapping<nv_bfloat16, int64_t>(
      static_cast<nv_bfloat16*>(k), static_cast<nv_bfloat16*>(v), slots, sizes[0], sizes[1], sizes[2], sizes[3],
      sizes[4], s[0], s[1], s[2], s[3], kc, vc, ksf, vsf, s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12],
      s[13], s[14], s[15], k_scale, v_scale, nullptr);
}
"""
_BINDING = r"""
#include <torch/extension.h>

int fa2_launch(void*, void*, int64_t*, const int64_t*, const int64_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*,
               float*, float*);

void fa2_write(torch::Tensor k, torch::Tensor v, torch::Tensor slots, torch::Tensor kc, torch::Tensor vc,
               torch::Tensor ksf, torch::Tensor vsf, torch::Tensor k_scale, torch::Tensor v_scale) {
  // nnz, heads, page_size, pages, head_dim / 2 (HND views: [pages, heads, page_size, ...])
  std::vector<int64_t> sizes{slots.size(0), kc.size(1), kc.size(2), kc.size(0), kc.size(3)};
  std::vector<int64_t> strides{k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  for (const auto& t : {kc, vc, ksf, vsf}) strides.insert(strides.end(), {t.stride(0), t.stride(2), t.stride(1)});
  int status = fa2_launch(k.data_ptr(), v.data_ptr(), slots.data_ptr<int64_t>(), sizes.data(), strides.data(),
                          kc.data_ptr<uint8_t>(), vc.data_ptr<uint8_t>(), static_cast<uint8_t*>(ksf.data_ptr()),
                          static_cast<uint8_t*>(vsf.data_ptr()), k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
  TORCH_CHECK(status == 0, "FlashInfer's NVFP4QuantizeAppendPagedKVCacheWithSlotMapping: cudaError ", status);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fa2_write", &fa2_write); }
"""


def build(include: Path, arch: str, folder: Path):  # noqa: ANN201 (the module torch builds)
    """FlashInfer's launcher built in `folder` for compute capability `arch` ("9.0") with FlashInfer's JIT flags and
    its vendored CCCL (`include`/../cccl, ahead of CUDA's); torch's own flags that hide bf16 and half operators are
    undone, as FlashInfer's JIT never sets them."""
    from torch.utils.cpp_extension import load

    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    undo = [f"-U__CUDA_NO_{name}__" for name in ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_CONVERSIONS",
                                                   "HALF2_OPERATORS")]
    (folder / "launch.cu").write_text(_LAUNCHER)
    (folder / "binding.cpp").write_text(_BINDING)
    return load("fp8kv_flashinfer_nvfp4_write", [str(folder / "binding.cpp"), str(folder / "launch.cu")],
                extra_cuda_cflags=[*JIT_FLAGS, *undo], extra_include_paths=[str(include.parent / "cccl"), str(include)],
                build_directory=str(folder))


def flashinfer_pages(include: Path, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """FlashInfer's slot-mapping write of `k`, `v` at each of SCALES, each uint8 `[NUM_PAGES - 1, page bytes]`."""
    with tempfile.TemporaryDirectory(prefix="fp8kv-nvfp4-build-") as folder:
        module = build(include, "{}.{}".format(*torch.cuda.get_device_capability()), Path(folder))
    page_bytes = 2 * KV_HEADS * PAGE_SIZE * (HEAD_DIM // 2 + HEAD_DIM // 16)
    out = []
    for k_scale, v_scale in SCALES:
        pages = torch.zeros(NUM_PAGES, page_bytes, dtype=torch.uint8, device="cuda")
        (kc, vc), (ksf, vsf) = fa2_views(pages)
        scales = [torch.tensor([s], dtype=torch.float32, device="cuda") for s in (k_scale, v_scale)]
        module.fa2_write(k.cuda(), v.cuda(), slots().cuda(), kc, vc, ksf, vsf, *scales)
        torch.cuda.synchronize()
        out.append(pages[1:].cpu())
    return out


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


def recording(k: torch.Tensor, v: torch.Tensor, pages: list[torch.Tensor], *, swizzled_v: bool, **meta: object) -> dict:
    """The JSON record of a write of `k`, `v` into `pages` (one per SCALES pair), with `meta` about who wrote it."""
    return {**meta, "kv_heads": KV_HEADS, "page_size": PAGE_SIZE, "head_dim": HEAD_DIM, "layout": "HND",
            "swizzled_v": swizzled_v, "inputs": {"k": _hex(k), "v": _hex(v)},
            "runs": [{"k_scale": ks, "v_scale": vs, "pages": _hex(p)} for (ks, vs), p in zip(SCALES, pages)]}


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--include", type=Path, required=True, help="FlashInfer's include folder (holds flashinfer/)")
    options.add_argument("--out", type=Path, required=True)
    args = options.parse_args()
    k, v = inputs()
    pages = flashinfer_pages(args.include, k, v)
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    recorded = recording(
        k, v, pages, swizzled_v=False,  # the fa2 write keeps both block scales linear
        probe="probes/gpu_nvfp4.py", how="run",
        engine="flashinfer 0.7.0.post1 NVFP4QuantizeAppendPagedKVCacheWithSlotMapping (vLLM 0.32.0's fa2 write)",
        headers_sha256={h: hashlib.sha256((args.include / "flashinfer" / h).read_bytes()).hexdigest() for h in HEADERS},
        flags=list(JIT_FLAGS), nvcc=next(line for line in nvcc.splitlines() if "release" in line),
        device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recorded, indent=1) + "\n")
    differences = compare(recorded)
    print_differences(differences)
    sys.exit(1 if any(run.differ for run in differences) else 0)


if __name__ == "__main__":
    main()
