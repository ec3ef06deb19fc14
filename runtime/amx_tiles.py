"""Sums as vLLM CPU's AMX tiles form them, for the runtime's `vllm-cpu-amx` attention: `tile_matmul`.

One tile instruction (TDPBF16PS) takes `AMX_TILE_DEPTH` terms: it runs the even and the odd ones as two fused
multiply-add chains from zero, adds the two chains, then adds that to the running total. Every one of those
results below the flush floor in magnitude is a float32 subnormal the tile flushes to zero, so a small product is
kept only when it joins a large sum in its own chain. Float32 products of bf16 and fp8 values are exact, so each
step rounds once.

Each step depends on the one before, so in torch every term is two passes over the whole output
(`torch_tile_matmul`). A small C kernel (amx_tiles.c) runs the same steps in the CPU's vector registers, one
instruction a step, the same bits: the whole amx attention call of a SmolLM2-shaped prefill (8 x 256 tokens, 2 cores)
takes 27 ms against 82 ms in torch and 12 ms for the exact float32 read (bench/bench_amx_attention.py). Each process
builds it with the system's C compiler (`$CC`, else `cc`) on first use; where it does not build (no compiler, not
x86 with fused multiply-add), torch sums them (`tile_sums_route` says which).
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import Callable

import torch

from fp8kv.ckernel import build, route

AMX_TILE_DEPTH = 32  # terms one AMX tile instruction sums: 16 bf16 pairs, head dims for Q·K, keys for P·V
KERNEL_SOURCE = Path(__file__).with_name("amx_tiles.c")
COMPILE_FLAGS = ("-O3", "-march=native")  # the CPU's own vector width and fused multiply-add


def flush(x: torch.Tensor, floor: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """What an AMX tile takes of `x`: zero where |x| is below `floor` (into `out` where given, in place if `x`)."""
    return torch.hardshrink(x, _below(floor), out=out)


@functools.cache
def _below(floor: float) -> float:
    """The float32 just below `floor`: hardshrink zeroes |x| up to its bound, `floor` itself kept."""
    return float(torch.nextafter(torch.tensor(floor), torch.tensor(0.0)))


def tile_matmul(a: torch.Tensor, w: torch.Tensor, floor: float) -> torch.Tensor:
    """`a` `[B, M, T]` (bf16 values) times `w` `[B, T, N]` (fp8 values, any strides), float32, each sum over T formed as
    the tiles form it, flushing below `floor`: `[B, M, N]`."""
    # the kernel reads host memory, and scales by powers of two alone (every floor of an fp8 format is one)
    kernel, _ = _kernel() if a.device.type == "cpu" and math.frexp(floor)[0] == 0.5 else (None, "")
    if kernel is None:
        return torch_tile_matmul(a, w, floor)
    batches, rows, terms = a.shape
    columns = w.shape[-1]
    # w scaled so that the floor is float32's smallest normal, where the CPU's flush-to-zero mode flushes: a power
    # of two, and fp8 values keep every bit of theirs as float32 subnormals
    scale = torch.finfo(torch.float32).smallest_normal / floor
    a, w = a.float().contiguous(), w.float() * scale
    out = a.new_empty(batches, rows, columns)
    # one thread: torch's own threads spin a while after each of its operations, and a second thread of sums
    # between them runs no faster
    kernel(a.data_ptr(), w.data_ptr(), out.data_ptr(), batches, rows, terms, columns, w.stride(0), w.stride(1),
           AMX_TILE_DEPTH, 1 / scale)
    return out


def torch_tile_matmul(a: torch.Tensor, w: torch.Tensor, floor: float) -> torch.Tensor:
    """`tile_matmul` in torch, one pass over the output per multiply-add and per flush (the kernel's reference)."""
    out = a.new_empty(a.shape[0], a.shape[1], w.shape[-1])
    # term t: a's column t `[B, M, 1]` times w's row t `[B, 1, N]`, a whole output at once
    terms = list(zip(a.transpose(1, 2).contiguous()[..., None].unbind(1), w[:, :, None, :].unbind(1)))
    even, odd = torch.empty_like(out), torch.empty_like(out)
    out.zero_()
    for start in range(0, len(terms), AMX_TILE_DEPTH):
        for chain, first in ((even, start), (odd, start + 1)):
            chain.zero_()
            for column, row in terms[first : start + AMX_TILE_DEPTH : 2]:
                flush(chain.addcmul_(column, row), floor, out=chain)
        flush(even.add_(odd), floor, out=even)
        flush(out.add_(even), floor, out=out)
    return out


def tile_sums_route() -> str:
    """How `tile_matmul` sums on this machine: the compiled kernel, or torch and why."""
    return route(_kernel())


@functools.cache
def _kernel() -> tuple[Callable[..., None] | None, str]:
    """The kernel's function (None where there is none) and how it came or why not (`ckernel.build`: 0.3 s)."""
    return build(KERNEL_SOURCE, "tile_matmul", COMPILE_FLAGS,
                 [ctypes.c_void_p] * 3 + [ctypes.c_long] * 7 + [ctypes.c_float])
