"""Which KV cache an evaluation runs on: dtype, where its scales come from, how the engine casts.

    spec = CacheSpec.parse(kv_cache="fp8", scales="checkpoint", engine="sglang")
    runner = open_runner(model_dir, spec, device="cpu", max_model_len=2048, max_num_seqs=8)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.errors import Fp8kvError
from fp8kv.engine_models import DEFAULT_ENGINE, engine_model
from fp8kv.options import EvalCache, ScaleSource
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify.accuracy import runtime_scales

KV_CACHES: tuple[str, ...] = get_args(EvalCache)
SCALE_SOURCES: tuple[str, ...] = get_args(ScaleSource)


@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration: `kv_cache` bf16 or fp8; for fp8, the scale source and the engine's cast.

    `query`: attention also reads Q as fp8 with the checkpoint's q_scale (fp8 attention kernels).
    """

    kv_cache: str = "fp8"
    scales: str = "checkpoint"
    engine: str = DEFAULT_ENGINE
    query: bool = False

    @classmethod
    def parse(cls, kv_cache: str = "fp8", scales: str = "checkpoint", engine: str = DEFAULT_ENGINE,
              query: bool = False) -> CacheSpec:
        """Validate the choices (one clear error naming the bad one)."""
        for name, value, choices in (("kv_cache", kv_cache, KV_CACHES), ("scales", scales, SCALE_SOURCES)):
            if value not in choices:
                raise Fp8kvError(f"{name}={value!r} is not one of {', '.join(choices)}")
        engine = engine_model(engine).name
        if query and (kv_cache, scales) != ("fp8", "checkpoint"):
            raise Fp8kvError("quantize_query needs kv_cache=fp8 and scales=checkpoint (q_scale comes from the checkpoint)")
        return cls(kv_cache, scales, engine, bool(query))

    @property
    def label(self) -> str:
        """Short name for tables: `bf16`, `fp8 unit vllm-tpu`, `fp8 checkpoint sglang`."""
        if self.kv_cache == "bf16":
            return "bf16"
        return f"fp8 {self.scales} {self.engine}" + (" + fp8 Q" if self.query else "")


def engine_arguments(engine: str) -> dict[str, Any]:
    """The runner's keyword for an engine model (`fp8kv.engine_models`)."""
    return {"engine": engine}


def open_runner(model_dir: str | Path, spec: CacheSpec, *, device: str, max_model_len: int, max_num_seqs: int,
                page_size: int = 16, model: torch.nn.Module | None = None) -> PagedModelRunner:
    """A runner whose cache follows `spec`; checkpoint scales are read as verify reads them (any convention)."""
    common = dict(device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs, page_size=page_size,
                  model=model)
    if spec.kv_cache == "bf16":
        return PagedModelRunner(model_dir, cache_dtype="bf16", **common)
    readout = read_kv_scales(model_dir)
    if spec.scales == "unit":
        return PagedModelRunner(model_dir, cache_dtype=readout.kv_dtype, **engine_arguments(spec.engine), **common)
    if readout.scales is None:
        raise Fp8kvError(f"{model_dir}: no KV scales in any convention; use scales=unit or calibrate it first")
    problems = readout.scales.problems()
    if problems:
        raise Fp8kvError(f"{model_dir}: {problems[0]}")
    layers = readout.source.geometry.kv_layers
    k, v = runtime_scales(readout.scales, layers)
    q = None
    if spec.query:
        if readout.scales.q is None:
            raise Fp8kvError(f"{model_dir}: no q_scale; calibrate with --attention fp8 or drop quantize_query")
        q = {i: readout.scales.q_value(i) for i in layers}
    return PagedModelRunner(model_dir, cache_dtype=readout.scales.kv_dtype, k_scales=k, v_scales=v, q_scales=q,
                            **engine_arguments(spec.engine), **common)
