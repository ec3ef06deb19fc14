"""The model card's sections for an NVFP4 KV cache: what the stored global scale is, what each engine release runs
with it per GPU generation, and how to serve it. The fp8 sections (the clamp, the fp8 limitations) do not apply; the
verify section is the one fp8 folders have, with its NVFP4 engine paths."""

from __future__ import annotations

from pathlib import Path

from fp8kv.checkpoint.nvfp4 import nvfp4_convention
from fp8kv.checkpoint.provenance import Provenance
from fp8kv.console import fmt_number
from fp8kv.kvdtypes import E2M1_MAX, NVFP4_BLOCK_SIZE
from fp8kv.options import FP8_K_NVFP4_V
from fp8kv.serving import NO_FP8_K_NVFP4_V_RELEASE, nvfp4_lines, nvfp4_serve_commands, nvfp4_traits_of


def nvfp4_scales(out: Path, prov: Provenance) -> str:
    """The card's scale section: the stored value's meaning and each release's reading of it (for the model in
    `out`)."""
    row = nvfp4_convention(prov.format)
    headroom = f" × {fmt_number(prov.headroom)}" if prov.headroom is not None else ""
    side = "V (K is an fp8 e4m3 cache with the fp8 scale amax / 448)" if prov.kv_dtype == FP8_K_NVFP4_V else "K and V"
    return "\n\n".join([
        "## KV-cache scales (NVFP4)",
        f"The cache stores {side} as e2m1 values (at most {E2M1_MAX:g}) in blocks of {NVFP4_BLOCK_SIZE} along "
        "the head dimension, each block with an e4m3 scale, under one global scale per layer and side: the one in "
        f"this checkpoint, `amax{headroom} / {row.divisor:g}` ({row.name}, as {row.producer} store it), amax being "
        "the largest |value| of that layer's cached K (or V, after RoPE and any k_norm) over all calibration tokens.",
        "What each engine release makes of it (read from their sources; nothing here ran on a GPU):\n\n"
        + "\n".join(f"- {line}" for line in nvfp4_lines(row.divisor, prov.headroom, prov.kv_dtype or "", nvfp4_traits_of(out))),
    ])


def nvfp4_serve(model: str, kv_dtype: str) -> str:
    """The card's serve section: one command per engine's newest release read."""
    commands = "\n".join(nvfp4_serve_commands(model, kv_dtype))
    if not commands:
        return (f"## How to serve\n\n{NO_FP8_K_NVFP4_V_RELEASE}: each release above runs another cache with this "
                "folder. `fp8kv verify` judges it on fp8kv's own arithmetic.")
    return f"## How to serve\n\nThe global scales are used when the KV cache is NVFP4:\n\n```bash\n{commands}\n```"

