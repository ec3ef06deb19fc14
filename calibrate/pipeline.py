"""The calibration driver: data in, observation, scale math, checkpoint out.

    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    result = calibrate(CalibrationRequest(model="path/to/model", out=Path("out")))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8kv import __version__
from fp8kv.calibrate import distributed, layerwise
from fp8kv.calibrate.request import CalibrationRequest, check_calibration_request
from fp8kv.data import (
    GENERATED_DATASET, CalibrationData, load_calibration_data, load_tokenizer, make_batches, pad_id, sample_digests,
)
from fp8kv.observe import KVStatistics, Progress, observe, query_observer_for
from fp8kv.checkpoint.locate import infer_base_model, is_bundled_model, resolve_model
from fp8kv.calibrate.scales import (
    ScaleTable, compute_scales, fp8_max, scale_from_amax,
)
from fp8kv.checkpoint.provenance import (
    CacheRecord, DatasetRecord, Execution, LayerRecord, Provenance, QueryScaleRecord, SourceRecord,
)
from fp8kv.checkpoint.conventions import CONVENTIONS, vllm_format_gaps
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.latent import check_latent_attention, check_latent_convention
from fp8kv.checkpoint.load import load_language_model
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.writer import (
    MODES, check_output, check_weight_method, write_checkpoint,
)
from fp8kv.errors import Fp8kvError
from fp8kv.options import LAST_BATCH, Strategy, check_headroom
from fp8kv.geometry import AttentionGeometry
from fp8kv.progress import StageProgress, announce, stage_callback
from fp8kv.runtime.device import resolve_device

SCALE_FORMULA = (
    "float32: scale = clip / fp8_max * headroom, then raised one float32 step at a time until clip / scale <= "
    "fp8_max; clip is the amax with strategy amax"
)


@dataclass(frozen=True)
class CalibrationResult:
    """The scales, the provenance written to fp8kv.json, and where the checkpoint went."""

    source: Path
    out: Path | None
    table: ScaleTable
    scales: KVScales
    provenance: Provenance
    warnings: list[str]
    note: str | None


def calibrate(request: CalibrationRequest, progress: StageProgress | None = None) -> CalibrationResult:
    """Calibrate static K/V scales for `request.model` and (with `request.out`) write the checkpoint.

    Everything is validated before the model loads; nothing is written unless every cache-owning
    layer got a finite, non-zero scale (or `allow_unobserved`). A note about the data (a fallback
    corpus, fewer samples) goes to `progress.note` before the observation starts.
    """
    strategy = _validate(request)
    announce(progress, "opening the checkpoint")
    source = SourceCheckpoint.open(resolve_model(request.model))
    if request.out is not None:
        check_output(source.path, request.out, request.overwrite)
        check_weight_method(request.convention, source)
        check_latent_convention(source.geometry, request.convention, "attn_head" if request.per_head else "tensor",
                                str(source.path / "config.json"))
    check_architecture(source, request.trust_remote_code)
    check_latent_attention(source.geometry, request.attention, str(source.path / "config.json"))
    tokenizer = load_tokenizer(source.path, request.trust_remote_code)
    announce(progress, "loading calibration data")
    data = _calibration_text(request, source, tokenizer)
    if data.note and progress is not None:
        progress.note(data.note)
    device = resolve_device(request.device, torch_only=True).device
    observing = stage_callback(progress, f"observing K/V over {len(data.samples)} samples")
    with distributed.process_group(device):
        by_layer = layerwise.choose_layerwise(request.layerwise, source, request.dtype)
        execution = Execution(by_layer, distributed.world_size(), str(device))
        announce(progress, "loading the model" + (" (one layer at a time)" if by_layer else ""))
        query = torch.zeros(source.geometry.num_layers) if request.attention == "fp8" else None
        if query is not None and (by_layer or distributed.world_size() > 1):
            raise Fp8kvError("--attention fp8 runs in one process with the whole model (not --layerwise or torchrun)")
        last_batch = _last_batch_statistics(strategy, source.geometry, by_layer)
        if by_layer:
            statistics = layerwise.observe_layerwise(source, data, request, tokenizer, observing)
        else:
            statistics = observe_whole_model(source, data, request, tokenizer, observing, query, last_batch)
        statistics = distributed.reduce_statistics(statistics, device)
    if not request.allow_unobserved:
        check_every_cache_seen(statistics, source)
    table = compute_scales(
        statistics,
        source.geometry.kv_layers,
        kv_dtype=request.kv_dtype,
        strategy=strategy,
        headroom=request.headroom,
        per_head=request.per_head,
        allow_unobserved=request.allow_unobserved,
        last_batch=last_batch,
    )
    scales = KVScales.from_tensors(k=table.tensors(0), v=table.tensors(1), kv_dtype=request.kv_dtype,
                                   q=None if query is None else query_scales(query, source.geometry.kv_layers,
                                                                                request.kv_dtype, request.headroom))
    warnings = [
        f"layer {layer}: nothing was observed (zero or no K/V); wrote scale 1.0 (--allow-unobserved)"
        for layer in table.defaulted
    ]
    gap = vllm_format_gaps((request.convention,), list(source.weight_map), source.geometry.model_type,
                           source.geometry.kv_layers[0])
    warnings += [gap] if gap and request.out is not None else []
    query_rows = None if query is None else tuple(
        QueryScaleRecord(i, float(query[i]), scales.q[i]) for i in source.geometry.kv_layers)
    record = provenance(request, source, data, table, strategy, execution, query_rows)
    if request.out is not None and distributed.is_writer():
        announce(progress, f"writing {request.out}")
        write_checkpoint(
            source.path,
            request.out,
            scales,
            convention=request.convention,
            mode=request.mode,
            overwrite=request.overwrite,
            record=record,
        )
    return CalibrationResult(source.path, request.out, table, scales, record, warnings, data.note)


def _calibration_text(request: CalibrationRequest, source: SourceCheckpoint, tokenizer: Any) -> CalibrationData:
    """The calibration samples; the model is loaded first only when it writes them (`--dataset generated`)."""
    model = None
    if request.data.dataset == GENERATED_DATASET:
        device = resolve_device(request.device, torch_only=True).device
        model = load_language_model(source.path, device, request.dtype, request.trust_remote_code)
    return load_calibration_data(request.data, tokenizer, fallback=is_bundled_model(source.path), model=model)


def observe_whole_model(source: SourceCheckpoint, data: CalibrationData, request: CalibrationRequest,
                        tokenizer: Any, progress: Progress | None = None, query: torch.Tensor | None = None,
                        last_batch: KVStatistics | None = None) -> KVStatistics:
    """Load the whole model once and observe this rank's share of the batches (see `fp8kv.observe.observe`)."""
    device = resolve_device(request.device, torch_only=True).device
    observer = None if query is None else query_observer_for(source.config)
    model = load_language_model(source.path, device, request.dtype, request.trust_remote_code, observer)
    batches = distributed.shard_batches(make_batches(data.samples, request.batch_size, pad_id(tokenizer)))
    return observe(model, batches, source.geometry, progress, query, last_batch)


def query_scales(query_amax: torch.Tensor, kv_layers: tuple[int, ...], kv_dtype: str,
                 headroom: float) -> dict[int, torch.Tensor]:
    """q_scale per KV layer from max |Q| (the same formula and headroom as K/V); an unobserved Q is an error."""
    bad = [i for i in kv_layers if not (math.isfinite(float(query_amax[i])) and float(query_amax[i]) > 0)]
    if bad:
        raise Fp8kvError(f"layers {bad}: the query was zero, NaN or never seen; no q_scale can be computed")
    return {i: scale_from_amax(query_amax[i].reshape(1), kv_dtype, headroom) for i in kv_layers}


def _last_batch_statistics(strategy: Strategy, geometry: AttentionGeometry, by_layer: bool) -> KVStatistics | None:
    """Empty statistics for the final batch when the strategy needs them (whole model, one process only)."""
    if strategy.name != LAST_BATCH:
        return None
    if by_layer or distributed.world_size() > 1:
        raise Fp8kvError(
            "--strategy last-batch (llm-compressor's default observer, for comparison) runs the whole model in "
            "one process; pass --no-layerwise and run without torchrun"
        )
    return KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads)


def check_every_cache_seen(statistics: KVStatistics, source: SourceCheckpoint) -> None:
    """Refuse when a layer the config gives a K/V cache never handed K/V to the cache during the forward."""
    silent = [layer for layer in source.geometry.kv_layers if int(statistics.tokens[layer]) == 0]
    if silent:
        raise Fp8kvError(
            f"{source.path / 'config.json'}: layers {silent} own a K/V cache by the config "
            f"(layer types {sorted({source.geometry.layer_types[i] for i in silent})}) but never passed K/V to "
            f"the cache's update in the {source.geometry.model_type} forward, so fp8kv cannot see what they "
            "would cache; no checkpoint written"
        )


def check_architecture(source: SourceCheckpoint, trust_remote_code: bool) -> None:
    """Refuse a model_type transformers cannot build (before any data or weights load)."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = source.geometry.model_type
    if model_type in CONFIG_MAPPING or (trust_remote_code and "auto_map" in source.config):
        return
    hint = " (its own code is in auto_map: pass --trust-remote-code if you trust it)" if "auto_map" in source.config else ""
    raise Fp8kvError(
        f"{source.path / 'config.json'}: model_type {model_type!r} is not an architecture transformers "
        f"{transformers_version} knows{hint}"
    )


def provenance(
    request: CalibrationRequest,
    source: SourceCheckpoint,
    data: CalibrationData,
    table: ScaleTable,
    strategy: Strategy,
    execution: Execution,
    query_scales: tuple[QueryScaleRecord, ...] | None = None,
) -> Provenance:
    """The fp8kv.json record: tool, command, source, data, settings, how it ran, and per-layer results."""
    return Provenance(
        version=__version__,
        command=request.command,
        # Hashing reads every source byte; under torchrun only the rank that writes and prints needs it.
        source=SourceRecord(
            path=str(source.path),
            content_hash=source.content_hash() if distributed.is_writer() else None,
            base_model=request.base_model or infer_base_model(request.model, source.path),
        ),
        dataset=DatasetRecord(data.dataset, data.split, data.text_column, len(data.samples), data.num_tokens,
                              request.data.seq_len, request.data.seed, data.note, sample_digests(data.samples)),
        strategy=str(strategy),
        headroom=request.headroom,
        scale_formula=SCALE_FORMULA,
        kv_dtype=request.kv_dtype,
        fp8_max=fp8_max(request.kv_dtype),
        per_head=request.per_head,
        format=request.convention,
        execution=execution,
        skipped_layers=tuple(source.geometry.skipped_layers),
        defaulted_layers=tuple(table.defaulted),
        layers=layer_rows(table),
        query_scales=query_scales,
    )


def layer_rows(table: ScaleTable) -> tuple[LayerRecord, ...]:
    """One record per cache-owning layer, every value a float (float32 values are exact in JSON).

    `clip` is the |x| the strategy mapped to MAX (the amax with `amax`), so
    `scale_from_amax(clip, kv_dtype, headroom)` recomputes `scale` bit for bit.
    With --per-head, `scale`/`clip` are the largest head's and `*_per_head` hold the written values.
    """
    def cache(i: int, kind: int) -> CacheRecord:
        scales, clip = table.scales[i, kind], table.clip[i, kind]
        return CacheRecord(
            amax=float(table.amax[i, kind].max()), clip=float(clip.max()), scale=float(scales.max()),
            saturation=float(table.saturation[i, kind]), amax_per_head=tuple(table.amax[i, kind].tolist()),
            clip_per_head=tuple(clip.tolist()) if table.per_head else None,
            scale_per_head=tuple(scales.tolist()) if table.per_head else None,
        )

    return tuple(LayerRecord(layer, table.headroom, cache(i, 0), cache(i, 1)) for i, layer in enumerate(table.layers))


def _validate(request: CalibrationRequest) -> Strategy:
    """Check every option before anything slow happens."""
    fp8_max(request.kv_dtype)
    strategy = Strategy.parse(request.strategy)
    check_headroom(request.headroom)
    if request.convention not in CONVENTIONS:
        raise Fp8kvError(f"--format {request.convention!r}: choose one of {', '.join(CONVENTIONS)}")
    if request.mode not in MODES:
        raise Fp8kvError(f"--mode {request.mode!r}: choose one of {', '.join(MODES)}")
    check_calibration_request(request)
    resolve_device(request.device, torch_only=True)
    return strategy
