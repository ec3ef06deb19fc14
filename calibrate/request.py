"""What a calibration run is asked to do: the options of `fp8kv calibrate`, as one frozen type."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fp8kv.checkpoint.artifacts import check_writable_location
from fp8kv.checkpoint.conventions import check_representable
from fp8kv.checkpoint.hub_cache import check_base_model
from fp8kv.data import DataRequest
from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import NVFP4_BLOCK_SIZE, NVFP4_KV_DTYPES
from fp8kv.options import DEFAULT_HEADROOM, DEFAULT_KV_DTYPE, DEFAULT_MODE


@dataclass(frozen=True)
class CalibrationRequest:
    """Everything `calibrate` needs; `fp8kv calibrate` takes its defaults from here."""

    model: str
    out: Path | None = None  # None: calibrate and report, write nothing
    data: DataRequest = field(default_factory=DataRequest)
    batch_size: int = 8
    kv_dtype: str = DEFAULT_KV_DTYPE
    strategy: str = "amax"
    headroom: float = DEFAULT_HEADROOM
    per_head: bool = False
    allow_unobserved: bool = False
    mode: str = DEFAULT_MODE
    convention: str = "compressed-tensors"
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    layerwise: bool | None = None  # None: layer by layer when the weights do not fit in memory
    base_model: str | None = None  # Hub id of the source; None: inferred (`infer_base_model`)
    attention: str = "kv"  # "fp8": also calibrate query scales (q_scale) for fp8 attention
    command: str | None = None  # the command line, recorded in fp8kv.json


def default_format(kv_dtype: str) -> str:
    """The format `--format` means when not given: compressed-tensors for fp8, ModelOpt's for the NVFP4 kv dtypes
    (the one format vLLM, SGLang and TensorRT-LLM read NVFP4 global scales from)."""
    return "modelopt" if kv_dtype in NVFP4_KV_DTYPES else CalibrationRequest.convention


def command_line() -> str:
    """The command as typed, for the provenance record (`CalibrationRequest.command`, convert's too)."""
    return shlex.join(["fp8kv", *sys.argv[1:]])


def check_calibration_request(request: CalibrationRequest) -> None:
    """Refuse options that cannot go together, a --base-model that is no Hub id and an --out that cannot be
    created; none needs the checkpoint, so the command line checks them before torch is imported."""
    if request.attention == "fp8" and request.convention != "compressed-tensors":
        raise Fp8kvError("--attention fp8 writes q_scale, which only the compressed-tensors format carries")
    if request.kv_dtype in NVFP4_KV_DTYPES and request.strategy.partition(":")[0] == "mse":
        raise Fp8kvError(f"--strategy mse minimises the fp8 cast's error; {request.kv_dtype}'s error is set per block "
                         f"of {NVFP4_BLOCK_SIZE} values, which it does not model: use amax or percentile:P")
    if request.base_model is not None:
        check_base_model(request.base_model)
    if request.out is not None:  # without --out nothing is written, so any format goes
        check_representable(request.convention, "attn_head" if request.per_head else "tensor", request.kv_dtype)
        check_writable_location(Path(request.out).absolute())
