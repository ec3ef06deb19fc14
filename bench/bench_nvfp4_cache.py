"""The NVFP4 cache's write and read over one layer's cache against the fp8 cache's, on the same CPU in one run.

    .venv/bin/python bench/bench_nvfp4_cache.py [--shapes smollm2,8b] [--tokens 2048] [--repeats 7]

Per shape (one KV layer: SmolLM2-135M's 3 KV heads of 64 dims, an 8B model's 8 of 128), each cache takes one
prefill's K and V (`--tokens` bf16 tokens, as verify's batch of 8 x 256 writes a layer) into 16-token pages with
`cache.write`, then the attention's read of them (`attention.gather_kv`, at the cache's `scale_args`), on one
thread (`--threads`). The NVFP4
write quantizes, stores the codes and block scales, and decodes them into the pages the attention reads (the
"fp8" read: e2m1 x block scale in e4m3, "float32": dequantized), so its decode is timed in the write. Median CPU
seconds of `--repeats` after one warm-up, the caches taking turns; the ratios to the fp8 row are of one run. Prints a table, writes
bench/results/nvfp4_cache.json.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fp8kv.kvdtypes import NVFP4_WRITES, SCALE_BOUND
from fp8kv.options import DEFAULT_KV_DTYPE, FOUR_OVER_SIX_WRITE, FP8_K_NVFP4_V
from fp8kv.runtime.attention import gather_kv
from fp8kv.runtime.cache import PagedKVCache
from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache

import common  # bench/common.py

SHAPES = {"smollm2": (3, 64), "8b": (8, 128)}  # KV heads, head_dim
PAGE_SIZE = 16
SEQ_LEN = 256  # tokens a sequence holds: --tokens / SEQ_LEN sequences
FP8 = "fp8"
# row -> (cache dtype, NVFP4 read); the fp8 row is fp8kv's fp8 e4m3 cache
CACHES = {FP8: (DEFAULT_KV_DTYPE, None), "nvfp4, fp8 read": ("nvfp4", "fp8"),
          "nvfp4, float32 read": ("nvfp4", "float32"), "nvfp4_4over6, fp8 read": (FOUR_OVER_SIX_WRITE, "fp8"),
          "fp8_k_nvfp4_v, float32 read": (FP8_K_NVFP4_V, "float32")}


@dataclass(frozen=True)
class Row:
    """One cache on one shape: median seconds of its write and its read, and their ratios to the fp8 cache's."""

    shape: str
    kv_heads: int
    head_dim: int
    tokens: int
    cache: str
    write_s: float
    read_s: float
    write_over_fp8: float = 1.0
    read_over_fp8: float = 1.0
    total_over_fp8: float = 1.0


def make_cache(name: str, kv_heads: int, head_dim: int, num_pages: int, scale: float) -> PagedKVCache:
    """The cache of row `name` with one KV layer (0) at global or fp8 scale `scale` on both sides."""
    dtype, read = CACHES[name]
    given = dict(kv_layers=(0,), num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=kv_heads, head_dim=head_dim,
                 device=torch.device("cpu"), k_scales={0: scale}, v_scales={0: scale})
    if dtype in (*NVFP4_WRITES, FP8_K_NVFP4_V):
        return Nvfp4PagedKVCache(**given, four_over_six=dtype == FOUR_OVER_SIX_WRITE, fp8_keys=dtype == FP8_K_NVFP4_V,
                                 read=read)
    return PagedKVCache(**given, dtype=torch.float8_e4m3fn)


def cpu_seconds(run: Callable[[], object]) -> float:
    """CPU seconds of one call: on one thread, the work done, which other jobs on the machine slow less than they
    slow the wall clock."""
    start = time.process_time()
    run()
    return time.process_time() - start


def bench_shape(shape: str, tokens: int, repeats: int) -> list[Row]:
    kv_heads, head_dim = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    amax = float(torch.maximum(k.abs().amax(), v.abs().amax()))
    seqs = tokens // SEQ_LEN
    pages_per_seq = SEQ_LEN // PAGE_SIZE
    # sequence s holds pages 1 + s * pages_per_seq ..., page 0 being the scratch page
    page_indices = torch.arange(1, seqs * pages_per_seq + 1, dtype=torch.int32).view(seqs, pages_per_seq)
    slots = torch.arange(PAGE_SIZE, (seqs * pages_per_seq + 1) * PAGE_SIZE)
    valid = torch.ones(tokens, dtype=torch.bool)
    kv_lens = torch.full((seqs,), SEQ_LEN, dtype=torch.int32)
    calls = {}
    for name in CACHES:
        cache = make_cache(name, kv_heads, head_dim, seqs * pages_per_seq + 1, amax / SCALE_BOUND["nvfp4"])
        calls[name] = (functools.partial(cache.write, 0, k, v, slots, valid),
                       functools.partial(gather_kv, cache.layer_pages(0), page_indices, kv_lens, *cache.scale_args(0)))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in CACHES}
    with torch.no_grad():
        for repeat in range(repeats + 1):  # the first is a warm-up; caches take turns, so load changes hit each alike
            for name, (write, read) in calls.items():
                if repeat:
                    times[name][0].append(cpu_seconds(write))
                    times[name][1].append(cpu_seconds(read))
                else:
                    write(), read()
    measured = {name: (statistics.median(w), statistics.median(r)) for name, (w, r) in times.items()}
    fp8_write, fp8_read = measured[FP8]
    return [Row(shape, kv_heads, head_dim, tokens, name, write, read, write / fp8_write, read / fp8_read,
                (write + read) / (fp8_write + fp8_read))
            for name, (write, read) in measured.items()]


def main() -> None:
    options = common.parser(__doc__.splitlines()[0])
    options.set_defaults(repeats=7)
    options.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    options.add_argument("--tokens", type=int, default=2048, help=f"tokens written per layer, a multiple of {SEQ_LEN}")
    options.add_argument("--threads", type=int, default=1, help="torch's CPU threads (CPU time is the work on one)")
    args = options.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for shape in args.shapes.split(",") for row in bench_shape(shape, args.tokens, args.repeats)]
    print(f"{'shape':8} {'cache':28} {'write ms':>9} {'read ms':>8} {'write/fp8':>9} {'read/fp8':>8} {'total/fp8':>9}")
    for r in rows:
        print(f"{r.shape:8} {r.cache:28} {r.write_s * 1e3:9.2f} {r.read_s * 1e3:8.2f} {r.write_over_fp8:9.2f} "
              f"{r.read_over_fp8:8.2f} {r.total_over_fp8:9.2f}")
    common.write_results("nvfp4_cache", [asdict(r) for r in rows], args)


if __name__ == "__main__":
    main()
