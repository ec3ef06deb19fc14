"""What a verify run is asked to do: the options of `fp8kv verify`, as one frozen type, importable without torch
(the command line reads its defaults from here before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8kv.data import DataRequest
from fp8kv.engine_models import RELEASED
from fp8kv.errors import Fp8kvError, UsageError
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


def check_verify_request(request: VerifyRequest) -> None:
    """Refuse numbers below 1 and a --prompts that is no file; the command line checks this before torch is
    imported."""
    for name, value in (("--batch-size", request.batch_size), ("--new-tokens", request.new_tokens),
                        ("--num-prompts", request.num_prompts), ("--prompt-len", request.prompt_len),
                        ("--num-samples", request.data.num_samples), ("--seq-len", request.data.seq_len)):
        if value < 1:
            raise Fp8kvError(f"{name} must be at least 1, got {value}")
    if request.data.seq_len < 2:  # a one-token sample has no next token to predict
        raise UsageError(f"--seq-len must be at least 2 for verify (perplexity scores every token after the first), "
                         f"got {request.data.seq_len}")
    if request.prompts is not None and Path(request.prompts).is_dir():
        raise Fp8kvError(f"{request.prompts}: is a folder; --prompts takes a text file, one prompt per line")
    if request.prompts is not None and not Path(request.prompts).is_file():
        raise Fp8kvError(f"{request.prompts}: no such prompts file (one prompt per line)")
