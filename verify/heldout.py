"""Held-out text and what the checkpoint's scales do to its K/V: max |x|/scale per layer.

The text is the bundled model's held-out split or `--dataset`, never silently the calibration data.
K and V are seen exactly as the cache stores them (after k_norm and RoPE, before the GQA repeat) by
the bf16 reference cache while verify prefills that text: its per-head amax over the scale is the ratio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.load import load_language_model
from fp8kv.checkpoint.locate import is_bundled_model
from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.data import (
    BUNDLED_DATASET, DATASET_CHOICES, GENERATED_DATASET, CalibrationData, DataRequest, load_calibration_data,
    samples_seen,
)
from fp8kv.errors import Fp8kvError, UsageError
from fp8kv.models import BUNDLED_HELDOUT_TEXT
from fp8kv.runtime.device import resolve_device
from fp8kv.verify.results import LayerRatio


def load_heldout(request: DataRequest, tokenizer: Any, source: SourceCheckpoint, device: str) -> CalibrationData:
    """Tokenized held-out samples: `request.dataset`, or the bundled held-out split when it is None (for the
    bundled models only: any other model gets one `UsageError` naming --dataset)."""
    if request.dataset is None and not is_bundled_model(source.path):
        raise UsageError(f"{source.path}: verify's default held-out text is the bundled model's corpus, which says "
                         f"nothing about this model; pass --dataset ({DATASET_CHOICES}), not its calibration text")
    if request.dataset == GENERATED_DATASET:
        model = load_language_model(source.path, resolve_device(device, torch_only=True).device)
        return load_calibration_data(request, tokenizer, model=model, held_out=True)
    if request.dataset in (None, BUNDLED_DATASET):
        if not BUNDLED_HELDOUT_TEXT.is_file():
            raise Fp8kvError(f"{BUNDLED_HELDOUT_TEXT}: the bundled held-out text is not installed; "
                             "pass --dataset with text the scales were not calibrated on")
        request = DataRequest(str(BUNDLED_HELDOUT_TEXT), request.split, request.text_column,
                              request.num_samples, request.seq_len, request.seed)
    return load_calibration_data(request, tokenizer)


def calibration_overlap(source: SourceCheckpoint, data: CalibrationData) -> str | None:
    """A warning when held-out samples are samples fp8kv.json says the scales were calibrated on (the same
    records, told by their digests; by dataset name and split in records that have none)."""
    record = read_provenance(source.path)
    dataset = record.dataset if record is not None else None
    if dataset is None:
        return None
    advice = "saturation and accuracy are measured on seen text; pass --dataset with other text"
    if not dataset.sample_digests:
        if (dataset.name, dataset.split) == (data.dataset, data.split):
            return (f"the held-out text {data.dataset} (split {data.split}) is the calibration data recorded in "
                    f"fp8kv.json: {advice}")
        return None
    shared = samples_seen(data.samples, dataset.sample_digests)
    if not shared:
        return None
    return (f"{shared} of {len(data.samples)} held-out samples begin with calibration samples recorded in "
            f"fp8kv.json: {advice}")


def max_ratio_rows(amax: Mapping[int, tuple[Sequence[float], Sequence[float]]], scales: KVScales,
                   kv_layers: tuple[int, ...]) -> list[LayerRatio]:
    """Per cache-owning layer: the largest |x| / scale of K and of V over the held-out text, from `amax`
    (per layer, K's and V's max |x| per KV head)."""

    def ratio(layer: int, kind: int) -> float:
        seen = torch.tensor(amax[layer][kind], dtype=torch.float64)  # [kv_heads]
        scale = scales.tensor("kv"[kind], layer).flatten().double().expand_as(seen)
        return float((seen / scale).max())

    return [LayerRatio(layer, ratio(layer, 0), ratio(layer, 1)) for layer in kv_layers]


def text_source(data: CalibrationData) -> str:
    """One line naming the text verify read."""
    bundled = Path(data.dataset) == BUNDLED_HELDOUT_TEXT
    name = f"bundled held-out split ({data.dataset})" if bundled else data.dataset
    return f"{name}, split {data.split}, column {data.text_column!r}"
