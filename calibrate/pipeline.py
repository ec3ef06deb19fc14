"""The calibration driver: data in, observation, scale math, checkpoint out.

    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    result = calibrate(CalibrationRequest(model="path/to/model", out=Path("out")))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fp8kv import __version__
from fp8kv.calibrate import distributed, layerwise
from fp8kv.calibrate.data import CalibrationData, DataRequest, load_calibration_data, make_batches
from fp8kv.calibrate.observe import KVStatistics, observe_batch, query_observer_for
from fp8kv.calibrate.resolve import infer_base_model, resolve_model
from fp8kv.calibrate.scales import (
    DEFAULT_HEADROOM, LAST_BATCH, ScaleTable, Strategy, compute_scales, fp8_max, scale_from_amax,
)
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE
from fp8kv.checkpoint.provenance import (
    CacheRecord, DatasetRecord, Execution, LayerRecord, Provenance, QueryScaleRecord, SourceRecord,
)
from fp8kv.checkpoint.conventions import CONVENTIONS, check_representable
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.load import load_causal_lm
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.writer import (
    MODES, check_output, check_weight_method, check_writable_location, write_checkpoint,
)
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.hub.resolve import is_repo_id
from fp8kv.progress import StageProgress, stage_callback

SCALE_FORMULA = (
    "float32: scale = clip / fp8_max * headroom, then raised one float32 step at a time until clip / scale <= "
    "fp8_max; clip is the amax with strategy amax"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Progress = Callable[[int, int], None]
"""Called with (samples done, samples total) after every batch (one stage of a `StageProgress`)."""


@dataclass(frozen=True)
class CalibrationRequest:
    """Everything `calibrate` needs; defaults match the CLI's."""

    model: str
    out: Path | None = None  # None: calibrate and report, write nothing
    data: DataRequest = field(default_factory=DataRequest)
    batch_size: int = 8
    kv_dtype: str = "fp8_e4m3"
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
    _stage(progress, "opening the checkpoint")
    source = SourceCheckpoint.open(resolve_model(request.model))
    if request.out is not None:
        check_output(source.path, request.out, request.overwrite)
        check_weight_method(request.convention, source)
    check_architecture(source, request.trust_remote_code)
    tokenizer = load_tokenizer(source.path, request.trust_remote_code)
    _stage(progress, "loading calibration data")
    data = load_calibration_data(request.data, tokenizer)
    if data.note and progress is not None:
        progress.note(data.note)
    device = resolve_device(request.device)
    observing = stage_callback(progress, f"observing K/V over {len(data.samples)} samples")
    with distributed.process_group(device):
        by_layer = layerwise.choose_layerwise(request.layerwise, source, request.dtype)
        execution = Execution(by_layer, distributed.world_size(), str(device))
        _stage(progress, "loading the model" + (" (one layer at a time)" if by_layer else ""))
        query = torch.zeros(source.geometry.num_layers) if request.attention == "fp8" else None
        if query is not None and (by_layer or distributed.world_size() > 1):
            raise Fp8kvError("--attention fp8 runs in one process with the whole model (not --layerwise or torchrun)")
        last_batch = _last_batch_statistics(strategy, source.geometry, by_layer)
        if by_layer:
            statistics = layerwise.observe_layerwise(source, data, request, tokenizer, observing)
        else:
            statistics = observe(source.path, source.config, source.geometry, data, request, tokenizer, observing,
                                 query, last_batch)
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
    scales = KVScales(k=table.tensors(0), v=table.tensors(1), kv_dtype=request.kv_dtype,
                      q=None if query is None else query_scales(query, source.geometry.kv_layers, request))
    warnings = [
        f"layer {layer}: nothing was observed (zero or no K/V); wrote scale 1.0 (--allow-unobserved)"
        for layer in table.defaulted
    ]
    query_rows = None if query is None else tuple(
        QueryScaleRecord(i, float(query[i]), float(scales.q[i])) for i in source.geometry.kv_layers)
    record = provenance(request, source, data, table, strategy, execution, query_rows)
    if request.out is not None and distributed.is_writer():
        _stage(progress, f"writing {request.out}")
        extra = {PROVENANCE_FILE: record.to_json().encode()}
        write_checkpoint(
            source.path,
            request.out,
            scales,
            convention=request.convention,
            mode=request.mode,
            overwrite=request.overwrite,
            extra_files=extra,
        )
    return CalibrationResult(source.path, request.out, table, scales, record, warnings, data.note)


def _stage(progress: StageProgress | None, stage: str) -> None:
    if progress is not None:
        progress(stage)


def observe(
    model_dir: Path,
    config: dict[str, Any],
    geometry: AttentionGeometry,
    data: CalibrationData,
    request: CalibrationRequest,
    tokenizer: Any,
    progress: Progress | None = None,
    query: torch.Tensor | None = None,
    last_batch: KVStatistics | None = None,
) -> KVStatistics:
    """Run the base model over every sample and return the folded K/V statistics (on the CPU).

    `query` (float32 [num_layers], CPU), when given, receives max |Q| per layer. With `last_batch`,
    the final batch is also folded into it alone (for `--strategy last-batch`).
    """
    device = resolve_device(request.device)
    observer = None if query is None else query_observer_for(config)
    model = load_model(model_dir, device, request.dtype, request.trust_remote_code, observer)
    batches = distributed.shard_batches(make_batches(data.samples, request.batch_size, pad_id(tokenizer)))
    total = sum(batch.input_ids.shape[0] for batch in batches)
    statistics = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, device)
    layers = frozenset(geometry.kv_layers)
    query_on_device = None if query is None else query.to(device)
    done = 0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            if last_batch is not None and index == len(batches) - 1:
                alone = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, device)
                observe_batch(model.base_model, ids, mask, alone, layers, query_on_device)
                statistics.merge(alone)
                last_batch.merge(alone.cpu())
            else:
                observe_batch(model.base_model, ids, mask, statistics, layers, query_on_device)
            done += ids.shape[0]
            if progress is not None:
                progress(done, total)
    if query is not None:
        query.copy_(query_on_device.cpu())
    return statistics.cpu()


def query_scales(query_amax: torch.Tensor, kv_layers: tuple[int, ...],
                 request: CalibrationRequest) -> dict[int, torch.Tensor]:
    """q_scale per KV layer from max |Q| (the same formula and headroom as K/V); an unobserved Q is an error."""
    bad = [i for i in kv_layers if not (math.isfinite(float(query_amax[i])) and float(query_amax[i]) > 0)]
    if bad:
        raise Fp8kvError(f"layers {bad}: the query was zero, NaN or never seen; no q_scale can be computed")
    return {i: scale_from_amax(query_amax[i].reshape(1), request.kv_dtype, request.headroom) for i in kv_layers}


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


def model_class(config: dict[str, Any]):
    """The transformers auto class that builds this checkpoint's language model with its weight names.

    `AutoModelForCausalLM` for every model_type it lists; vision-language wrappers it does not list
    (llava, qwen2-vl, ...) load as `AutoModelForImageTextToText`, whose base model runs the language
    model on text alone.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    model_type = config.get("model_type")
    return AutoModelForImageTextToText if model_type in VLM and model_type not in CAUSAL else AutoModelForCausalLM


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


def load_model(model_dir: Path, device: torch.device, dtype: str, trust_remote_code: bool,
               attn_implementation: str | None = None):
    """The language model (transformers' default attention unless given); only its base model is ever run."""
    from fp8kv.geometry import read_config

    if dtype != "auto" and dtype not in DTYPES:
        raise Fp8kvError(f"--dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = load_causal_lm(
        model_dir,
        model_class(read_config(model_dir)),
        **extra,
        dtype=DTYPES.get(dtype, "auto"),
        trust_remote_code=trust_remote_code,
    )
    return model.to(device).eval()


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


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise Fp8kvError(f"--device {device!r}: choose auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Fp8kvError("--device cuda: no CUDA device is available; use --device cpu")
    return torch.device(device)


def pad_id(tokenizer: Any) -> int:
    """The id right padding uses (its value never matters: padding is masked and never observed)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


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
                              request.data.seq_len, request.data.seed, data.note),
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
    if not request.headroom >= 1.0:
        raise Fp8kvError(f"--headroom must be at least 1.0, got {request.headroom}")
    if request.convention not in CONVENTIONS:
        raise Fp8kvError(f"--format {request.convention!r}: choose one of {', '.join(CONVENTIONS)}")
    if request.mode not in MODES:
        raise Fp8kvError(f"--mode {request.mode!r}: choose one of {', '.join(MODES)}")
    if request.attention == "fp8" and request.convention != "compressed-tensors":
        raise Fp8kvError("--attention fp8 writes q_scale, which only the compressed-tensors format carries")
    if request.base_model is not None and not is_repo_id(request.base_model):
        raise Fp8kvError(f"--base-model {request.base_model!r}: not a Hub model id org/name")
    if request.out is not None:  # without --out nothing is written, so any format goes
        check_representable(request.convention, "attn_head" if request.per_head else "tensor", request.kv_dtype)
        check_writable_location(Path(request.out).absolute())
    resolve_device(request.device)
    return strategy


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The checkpoint's own tokenizer, or one clear error naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise Fp8kvError(f"{model_dir}: no usable tokenizer ({exc})") from None
