"""The AMX tile sums: the compiled kernel gives the torch sums' bits, and without a compiler torch runs them."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fp8kv.runtime import amx_tiles
from fp8kv.runtime.attention import amx_flush, ragged_paged_attention
from fp8kv.runtime.amx_tiles import flush, tile_matmul, torch_tile_matmul

E4M3 = torch.float8_e4m3fn
FLOOR = amx_flush(E4M3)  # 2^-6


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The kernel built again by this test, into a temporary folder of its own (`tmp_path / "tmp"`)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR once, then keeps what it found
    build = amx_tiles._kernel  # the memoized one: a test may put another in its place
    build.cache_clear()
    yield tmp_path / "tmp"
    build.cache_clear()


def _builds_here() -> bool:
    """Whether this machine can build the kernel: a C compiler, and x86 with fused multiply-add."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return (shutil.which("cc") is not None and platform.machine() in ("x86_64", "AMD64", "i686")
            and " fma" in flags)


def _operands(batches: int, rows: int, terms: int, columns: int, seed: int, flushed: bool = True):
    """bf16 values of every magnitude times fp8 values (flushed below the floor as the attention's are), with
    zeros, exact cancellations and products at and just under the floor."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(batches, rows, terms, generator=g) * torch.rand(batches, rows, terms, generator=g) ** 6)
    w = (torch.randn(batches, terms, columns, generator=g) * 4 * torch.rand(batches, terms, columns, generator=g) ** 4)
    a, w = a.to(torch.bfloat16).float(), w.to(E4M3).float()
    a[:, :, ::7] = 0.0
    a[:, 0, :] = 2.0**-7  # times w = 2: exactly the floor; times the next fp8 value below 2: lost alone
    w[:, :, 0] = 2.0
    w[:, :, 1] = 1.875
    a[:, 1, :2], w[:, :2, 2] = 1.0, torch.tensor([3.0, -3.0])  # a chain that cancels to zero
    return a, (flush(w, FLOOR) if flushed else w)


@pytest.mark.parametrize("shape", [(3, 7, 45, 37), (2, 96, 64, 256), (1, 5, 3, 8), (4, 9, 70, 17)])
def test_the_kernel_gives_the_torch_sums_bits(shape, fresh_build) -> None:
    """Rows not a multiple of four, terms not of a tile's 32, columns not of a vector: every result bit for bit."""
    a, w = _operands(*shape, seed=sum(shape))
    expected = torch_tile_matmul(a, w, FLOOR)
    assert (expected == 0).any() and (expected.abs() >= FLOOR).any()
    assert torch.equal(tile_matmul(a, w, FLOOR), expected)


@pytest.mark.parametrize("shape", [(3, 7, 45, 37), (2, 96, 64, 256)])
def test_the_kernel_built_without_avx512_gives_the_same_bits(shape, fresh_build, tmp_path, monkeypatch) -> None:
    """A CPU without AVX-512 builds the kernel with 8-lane vectors: its sums are the same steps, so the same bits."""
    compiler = tmp_path / "cc-without-avx512"
    compiler.write_text('#!/bin/sh\nexec cc "$@" -mno-avx512f\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    route = amx_tiles.tile_sums_route()
    assert route == "compiled kernel" if _builds_here() else route.startswith("torch (")
    a, w = _operands(*shape, seed=sum(shape))
    assert torch.equal(tile_matmul(a, w[:, :, 1:], FLOOR), torch_tile_matmul(a, w[:, :, 1:], FLOOR))


def test_strided_w_and_unflushed_fp8_subnormals_sum_alike(fresh_build) -> None:
    """w as a slice of a wider tensor (the keys a block of queries sees), and w holding fp8 subnormals: the kernel
    reads them at their value, as torch does."""
    a, w = _operands(2, 12, 40, 64, seed=3, flushed=False)
    assert ((w != 0) & (w.abs() < FLOOR)).any()
    seen = w[:, :, :29]
    assert torch.equal(tile_matmul(a, seen, FLOOR), torch_tile_matmul(a, seen, FLOOR))


def test_the_kernel_builds_where_it_can_and_leaves_no_file(fresh_build) -> None:
    """On x86 with fused multiply-add and a C compiler (any machine vLLM CPU's amx path runs on) the sums run
    compiled; elsewhere torch runs them and the route says why. Either way nothing is left on disk."""
    route = amx_tiles.tile_sums_route()
    assert route == "compiled kernel" if _builds_here() else route.startswith("torch (")
    assert not list(fresh_build.iterdir())


def test_tensors_off_the_cpu_are_summed_by_torch(fresh_build) -> None:
    """The kernel reads host memory: a GPU's tensors (here the meta device, which holds no data) go to torch."""
    a, w = _operands(2, 6, 33, 20, seed=5)
    out = tile_matmul(a.to("meta"), w.to("meta"), FLOOR)
    assert out.device.type == "meta" and out.shape == (2, 6, 20)


def test_a_floor_not_a_power_of_two_is_summed_by_torch(fresh_build) -> None:
    """Scaling w to put such a floor on float32's smallest normal would round it: torch sums it instead."""
    a, w = _operands(2, 6, 33, 20, seed=5)
    assert torch.equal(tile_matmul(a, w, 0.01), torch_tile_matmul(a, w, 0.01))


def test_without_a_compiler_torch_sums_and_says_why(fresh_build, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    route = amx_tiles.tile_sums_route()
    assert route.startswith("torch (/nonexistent/cc -O3") and "No such file" in route
    a, w = _operands(2, 6, 33, 20, seed=5)
    assert torch.equal(tile_matmul(a, w, FLOOR), torch_tile_matmul(a, w, FLOOR))


@pytest.mark.parametrize("cache, extras", [
    (E4M3, {}),
    (torch.float8_e5m2, {}),  # its floor is 2^-14
    (E4M3, {"soft_cap": 30.0, "sliding_window": 24}),
    (E4M3, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])}),  # gpt-oss: Q·K only through the tiles
])
def test_the_amx_attention_is_the_same_through_either_route(cache, extras, fresh_build, monkeypatch) -> None:
    """A ragged prefill of three sequences (one continuing its cached context) over an fp8 cache, per-head scales:
    the same bits compiled and in torch."""
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim, page = 2, 3, 40, 16
    q_lens, kv_lens = [37, 5, 64], [37, 20, 64]
    pages = torch.zeros(1 + sum(-(-n // page) for n in kv_lens), page, 2 * kv_heads, dim)
    pages[1:] = torch.randn(pages.shape[0] - 1, page, 2 * kv_heads, dim, generator=g) * 3
    indices, first = [], 1
    for n in kv_lens:
        count = -(-n // page)
        indices.append(list(range(first, first + count)) + [0] * (4 - count))
        first += count
    batch = dict(
        q=(torch.randn(sum(q_lens), kv_heads * group, dim, generator=g)).to(torch.bfloat16),
        kv_pages=pages.to(cache), kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        page_indices=torch.tensor(indices, dtype=torch.int32),
        cu_q_lens=torch.tensor([0, 37, 42, 106], dtype=torch.int32), num_seqs=torch.tensor([3], dtype=torch.int32),
        sm_scale=dim**-0.5, k_scale=torch.tensor([0.5, 0.02]), v_scale=torch.tensor([0.25, 1.0]),
        numerics="vllm-cpu-amx", **extras)
    routed = ragged_paged_attention(**batch)
    assert torch.isfinite(routed).all()
    monkeypatch.setattr(amx_tiles, "_kernel", lambda: (None, "in torch on purpose"))
    assert torch.equal(ragged_paged_attention(**batch), routed)


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A "compiler" that writes a library of junk bytes wherever -o says."""
    script = tmp_path / "fake-cc"
    script.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho junk > "$2"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))


def test_a_library_that_does_not_load_leaves_the_sums_to_torch(fresh_build, fake_compiler) -> None:
    route = amx_tiles.tile_sums_route()
    assert route.startswith(f"torch ({os.environ['CC']} -O3") and "amx_tiles.so" in route
    assert not list(fresh_build.iterdir())
    a, w = _operands(1, 4, 8, 16, seed=7)
    assert torch.equal(tile_matmul(a, w, FLOOR), torch_tile_matmul(a, w, FLOOR))
