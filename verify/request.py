"""What a verify run is asked to do: the options of `fp8kv verify`, as one frozen type, importable without torch
(the command line reads its defaults from here before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8kv.data import DataRequest
from fp8kv.engine_models import RELEASED
from fp8kv.verify.verdict import Thresholds


@dataclass(frozen=True)
class VerifyRequest:
    """Everything `verify` needs; `fp8kv verify` takes its defaults from here. `data.dataset=None` is the bundled
    held-out split."""

    model_dir: Path | str  # a folder, a Hub id org/name[@revision], or "bundled"
    data: DataRequest = field(default_factory=lambda: DataRequest(num_samples=16, seq_len=256))
    batch_size: int = 4
    prompts: Path | None = None  # one prompt per line; None: the first held-out samples' prefixes
    num_prompts: int = 4
    prompt_len: int = 32
    new_tokens: int = 8
    device: str = "auto"
    page_size: int = 16
    report_dir: Path | None = None  # None: see `verify.run.report_location`
    thresholds: Thresholds | None = None  # None: configs/verify.toml
    engines: tuple[str, ...] = RELEASED  # engine models run through the runtime (verify.engines)
    quantize_query: bool = False  # also run attention with Q quantized by the checkpoint's q_scale
    # Engines that write the same bytes share one run on fp8kv's float32 attention; True also reproduces each
    # engine's own attention arithmetic (TPU: the Pallas kernel's), one more run per arithmetic.
    engine_attention: bool = False
