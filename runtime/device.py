"""Device choice for the runtime: TPU (torch_xla), XLA:CPU, CUDA or CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import get_args

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.options import RuntimeChoice

DEVICE_CHOICES = get_args(RuntimeChoice)


@dataclass(frozen=True)
class RuntimeDevice:
    """Where the runtime runs. `kind` is one of "tpu", "xla-cpu", "cuda", "cpu"."""

    kind: str
    device: torch.device

    @property
    def is_xla(self) -> bool:
        return self.kind in ("tpu", "xla-cpu")

    @property
    def head_dim_multiple(self) -> int:
        """vLLM's TPU backend pads head_dim to a multiple of 128; other devices need no padding."""
        return 128 if self.is_xla else 1


def resolve_device(choice: str = "auto") -> RuntimeDevice:
    """Turn a `--device` choice into a device.

    "auto" is the TPU when torch_xla sees one, else CUDA, else CPU. "xla-cpu" runs torch_xla on the
    host CPU (sets PJRT_DEVICE=CPU when unset), which is how TPU graphs are checked without a TPU.
    """
    if choice not in DEVICE_CHOICES:
        raise Fp8kvError(f"unknown device {choice!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if choice == "auto":
        choice = "tpu" if _tpu_chips() > 0 else "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return RuntimeDevice("cpu", torch.device("cpu"))
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise Fp8kvError("device 'cuda' requested but torch sees no CUDA device; use --device cpu")
        return RuntimeDevice("cuda", torch.device("cuda"))
    return RuntimeDevice(choice, _xla_device("TPU" if choice == "tpu" else "CPU"))


def tpu_version() -> int:
    """The TPU generation (4, 5, 6, ...), or 0 when torch_xla runs on something else."""
    try:
        import torch_xla.tpu

        return int(torch_xla.tpu.version())
    except Exception:  # torch_xla raises different errors off-TPU; any of them means "no TPU"
        return 0


def _tpu_chips() -> int:
    if os.environ.get("PJRT_DEVICE", "TPU").upper() != "TPU":
        return 0
    try:
        from torch_xla._internal import tpu
    except ImportError:
        return 0
    return tpu.num_available_chips()


def _xla_device(pjrt: str) -> torch.device:
    current = os.environ.setdefault("PJRT_DEVICE", pjrt)
    if current.upper() != pjrt:
        raise Fp8kvError(
            f"PJRT_DEVICE={current} is set but device '{pjrt.lower()}' was requested; "
            f"unset PJRT_DEVICE or set it to {pjrt}"
        )
    try:
        import torch_xla
    except ImportError:
        raise Fp8kvError("torch_xla is not installed; install fp8kv[tpu] or use --device cpu") from None
    return torch_xla.device()
