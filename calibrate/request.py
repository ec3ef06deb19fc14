"""What a calibration run is asked to do: the options of `fp8kv calibrate`, as one frozen type."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8kv.options import DEFAULT_HEADROOM, DEFAULT_KV_DTYPE
from fp8kv.data import DataRequest


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
    mode: str = "overlay"
    convention: str = "compressed-tensors"
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    layerwise: bool | None = None  # None: layer by layer when the weights do not fit in memory
    base_model: str | None = None  # Hub id of the source; None: inferred (`infer_base_model`)
    attention: str = "kv"  # "fp8": also calibrate query scales (q_scale) for fp8 attention
    command: str | None = None  # the command line, recorded in fp8kv.json
