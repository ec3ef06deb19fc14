"""Device choice for the runtime: TPU (torch_xla), XLA:CPU, CUDA or CPU."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.options import TPU_EXTRA_HINT, RuntimeChoice, TorchDeviceChoice
from fp8kv.runtime.kernel_rule import TPU_HEAD_DIM_MULTIPLE

DEVICE_CHOICES = get_args(RuntimeChoice)
TORCH_DEVICE_CHOICES = get_args(TorchDeviceChoice)
# torch_xla counts TPU chips among the PCI devices of Google's vendor id (some Google virtual NICs share it)
PCI_DEVICES = Path("/sys/bus/pci/devices")
GOOGLE_PCI_VENDOR = "0x1ae0"


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
        return TPU_HEAD_DIM_MULTIPLE if self.is_xla else 1


def resolve_device(choice: str = "auto", torch_only: bool = False) -> RuntimeDevice:
    """Turn a `--device` choice into a device.

    "auto" is the TPU when torch_xla sees one, else CUDA, else CPU. "xla-cpu" runs torch_xla on the
    host CPU (sets PJRT_DEVICE=CPU when unset), which is how TPU graphs are checked without a TPU.
    `torch_only` (calibration's observer, which runs transformers' own forward): CUDA or CPU only.
    """
    allowed = TORCH_DEVICE_CHOICES if torch_only else DEVICE_CHOICES
    if choice not in allowed:
        raise Fp8kvError(f"unknown device {choice!r}; choose one of {', '.join(allowed)}")
    if choice == "auto" and torch_only:
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "auto":
        on_tpu = os.environ.get("PJRT_DEVICE", "TPU").upper() == "TPU" and tpu_chips() > 0
        choice = "tpu" if on_tpu else "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return RuntimeDevice("cpu", torch.device("cpu"))
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise Fp8kvError("device 'cuda' requested but torch sees no CUDA device; use --device cpu")
        return RuntimeDevice("cuda", torch.device("cuda"))
    return RuntimeDevice(choice, _xla_device("TPU" if choice == "tpu" else "CPU"))


def may_use_xla(choice: str) -> bool:
    """Whether a runtime `choice` can end on a torch_xla device, decided without importing torch_xla."""
    if choice in ("tpu", "xla-cpu"):
        return True
    return choice == "auto" and os.environ.get("PJRT_DEVICE", "TPU").upper() == "TPU" and \
        importlib.util.find_spec("libtpu") is not None and _google_pci_device()


def _google_pci_device() -> bool:
    """Whether a PCI device of Google's vendor id is attached: without one there is no TPU chip, and torch_xla
    (seconds to import) need not be asked."""
    return any(vendor.read_text().strip() == GOOGLE_PCI_VENDOR for vendor in PCI_DEVICES.glob("*/vendor"))


def tpu_version() -> int:
    """The TPU generation (4, 5, 6, ...) through torch_xla's public `torch_xla.tpu`, or 0 without a TPU."""
    if tpu_chips() == 0:  # version() asks the cloud metadata server: only worth it with chips attached
        return 0
    import torch_xla  # torch_xla 2.9: `torch_xla.tpu` is an attribute; `import torch_xla.tpu` fails

    try:
        return int(torch_xla.tpu.version())
    except (OSError, KeyError):  # no metadata (not a Cloud TPU VM) or an unknown accelerator type
        return 0


def tpu_chips() -> int:
    """TPU chips attached to this host (0 without torch_xla)."""
    if not _google_pci_device():
        return 0
    try:
        import torch_xla
    except ImportError:
        return 0
    return torch_xla.tpu.num_available_chips()


def missing_for_tpu() -> str | None:
    """What keeps torch_xla from running on a TPU here, in one phrase, or None when nothing does."""
    if importlib.util.find_spec("torch_xla") is None:
        return f"torch_xla is not installed ({TPU_EXTRA_HINT})"
    if importlib.util.find_spec("libtpu") is None:
        return f"libtpu is not installed ({TPU_EXTRA_HINT})"
    pjrt = os.environ.get("PJRT_DEVICE", "TPU")  # read first: importing torch_xla sets it when unset
    if tpu_chips() == 0:
        return "no TPU chips are attached to this host (use --device xla-cpu for the same code path on the CPU)"
    if pjrt.upper() != "TPU":
        return f"PJRT_DEVICE={pjrt} is set (unset it or set it to TPU)"
    return None


def _xla_device(pjrt: str) -> torch.device:
    if pjrt == "TPU":
        missing = missing_for_tpu()
        if missing:
            raise Fp8kvError(f"device 'tpu' requested but {missing}")
    current = os.environ.setdefault("PJRT_DEVICE", pjrt)
    if current.upper() != pjrt:
        raise Fp8kvError(
            f"PJRT_DEVICE={current} is set but device '{pjrt.lower()}' was requested; "
            f"unset PJRT_DEVICE or set it to {pjrt}"
        )
    try:
        import torch_xla
    except ImportError:
        raise Fp8kvError(f"torch_xla is not installed: {TPU_EXTRA_HINT}, or use --device cpu") from None
    return torch_xla.device()
