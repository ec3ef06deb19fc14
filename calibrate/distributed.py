"""Calibration across processes: `torchrun --nproc-per-node N -m fp8kv calibrate ...`.

Every rank loads the same samples and builds the same batches; rank r observes batches
r, r+N, r+2N, ... Batches are never re-cut, so each one is computed exactly as in a single
process, and the reduced statistics (MAX of amax, SUM of histograms and token counts) are
bit-identical to a one-process run. Only rank 0 writes. torchrun's rendezvous makes this
work across hosts unchanged (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, TypeVar

import torch
import torch.distributed as dist

from fp8kv.observe import KVStatistics

T = TypeVar("T")


def world_size() -> int:
    """Processes taking part: the process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: the process group's, else torchrun's RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_writer() -> bool:
    """Only rank 0 writes the checkpoint and prints the report."""
    return rank() == 0


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join torchrun's process group for the duration (gloo on CPU, nccl on GPU).

    Does nothing in a single process, or when the caller already initialised a group
    (which then stays the caller's to destroy).
    """
    if world_size() == 1 or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with _stdout_to_stderr():  # gloo prints its connection lines on stdout, which --json keeps clean
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        dist.barrier()
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 (C++ prints included) to stderr for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def shard_batches(batches: list[T]) -> list[T]:
    """This rank's share of the batches: every world_size-th one, starting at its rank."""
    return batches[rank() :: world_size()]


def reduce_statistics(statistics: KVStatistics, device: torch.device) -> KVStatistics:
    """All ranks' statistics folded together (MAX of amax, SUM of counts), returned on the CPU."""
    if world_size() == 1 or not dist.is_initialized():
        return statistics.cpu()
    # nccl reduces device tensors only; gloo reduces CPU tensors.
    home = device if dist.get_backend() == "nccl" else torch.device("cpu")
    amax, hist, tokens = (t.to(home) for t in (statistics.amax, statistics.hist, statistics.tokens))
    nan = amax.isnan().to(torch.int32)  # a MAX reduction need not propagate NaN; the scale guard must see it
    for tensor, op in ((amax, dist.ReduceOp.MAX), (hist, dist.ReduceOp.SUM), (tokens, dist.ReduceOp.SUM), (nan, dist.ReduceOp.SUM)):
        dist.all_reduce(tensor, op=op)
    amax[nan > 0] = float("nan")
    return KVStatistics(amax, hist, tokens).cpu()
