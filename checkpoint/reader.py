"""Read KV scales from a checkpoint in any convention, by tensor name, never loading weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.conventions import (
    HF_QUANT_CONFIG, SCALE_CONVENTIONS, is_vllm_json, parse_scale_name, quantization_block,
)
from fp8kv.checkpoint.kvscales import KVScales, Shaped, float32
from fp8kv.checkpoint.nvfp4 import Nvfp4Reading, nvfp4_reading
from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.checkpoint.source import FLOAT_FORMATS, SourceCheckpoint, read_float_values
from fp8kv.geometry import read_json
from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import TORCH_DTYPE_NAME, kv_dtype_from_file
from fp8kv.options import DEFAULT_KV_DTYPE

# A per-head scale has one value per KV head; a longer vector is not a scale, and is never read.
_MAX_HEADS = 2**16
# Error messages name a dtype as torch spells it, which is how users write their checkpoints.
_TORCH_SPELLING = {"BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "I16": "torch.int16",
                   "U16": "torch.uint16", "I32": "torch.int32", "U32": "torch.uint32", "I64": "torch.int64",
                   "U64": "torch.uint64", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2"}


@dataclass(frozen=True)
class ScaleReadout:
    """What a checkpoint says about its KV cache.

    `conventions` lists every convention with scales present; `scales` is their agreed union
    (None when there are none); `declared` maps convention -> whether the config files
    announce a quantized KV cache (e.g. `kv_cache_scheme` in `quantization_config` or `compression_config`);
    `nvfp4`: what the stored values mean when the config files declare an NVFP4 cache (None: an fp8 one).
    """

    source: SourceCheckpoint
    conventions: tuple[str, ...]
    scales: KVScales | None
    kv_dtype: str
    declared: dict[str, bool]
    missing_layers: tuple[int, ...]
    unexpected_layers: tuple[int, ...]
    nvfp4: Nvfp4Reading | None = None

    @property
    def has_kv_cache_scheme(self) -> bool:
        """Whether config.json's quantization block (`quantization_config`, else `compression_config`) has a
        `kv_cache_scheme`."""
        qc = quantization_block(self.source.config)[1]
        return qc is not None and qc.get("kv_cache_scheme") is not None


def read_kv_scales(model_dir: str | Path) -> ScaleReadout:
    """Read every KV-scale convention in `model_dir`, one pass over the table of conventions; conventions that
    disagree are an error."""
    source = SourceCheckpoint.open(model_dir)
    hf_quant = read_json(source.path / HF_QUANT_CONFIG) if HF_QUANT_CONFIG in source.files else None

    def recorded_format() -> str | None:  # fp8kv.json, read only for a ModelOpt NVFP4 folder
        record = read_provenance(source.path)
        return record.format if record else None

    nvfp4 = nvfp4_reading(source.config, hf_quant, recorded_format, str(source.path))
    kv_dtype = nvfp4.kv_dtype if nvfp4 else _kv_dtype(source.config)
    tensors = _tensor_scales(source)
    found: dict[str, dict[int, dict[str, Shaped]]] = {}
    declared: dict[str, bool] = {}
    for convention in SCALE_CONVENTIONS:
        if convention.in_json:
            for name in source.files:
                if name.endswith(".json") and "/" not in name and is_vllm_json(source.path / name):
                    found[convention.name], kv_dtype = _vllm_json_scales(source.path / name)
        elif convention.name in tensors:
            found[convention.name] = tensors[convention.name]
        declared |= {key: field.holds(source.config, hf_quant) for key, field in convention.declarations}
    merged = _merge(found)
    complete = {i: kv for i, kv in merged.items() if "k" in kv and "v" in kv}
    scales = None
    if complete:
        with_query = all("q" in kv for kv in complete.values())
        scales = KVScales.from_shaped(k={i: kv["k"] for i, kv in complete.items()},
                                      v={i: kv["v"] for i, kv in complete.items()}, kv_dtype=kv_dtype,
                                      q={i: kv["q"] for i, kv in complete.items()} if with_query else None)
    kv_layers = source.geometry.kv_layers
    return ScaleReadout(
        source=source,
        conventions=tuple(found),
        scales=scales,
        kv_dtype=kv_dtype,
        declared=declared,
        missing_layers=tuple(i for i in kv_layers if i not in complete) if found else (),
        unexpected_layers=tuple(sorted(i for i in merged if i not in kv_layers)),
        nvfp4=nvfp4,
    )


def _tensor_scales(source: SourceCheckpoint) -> dict[str, dict[int, dict[str, Shaped]]]:
    """convention -> layer -> {"k"|"v"|"q": (shape, values)}, reading only the scale tensors' bytes."""
    found: dict[str, dict[int, dict[str, Shaped]]] = {}
    for file in source.weight_files:
        header = source.headers[file]
        wanted = {t: parsed for t in header if (parsed := parse_scale_name(t)) is not None}
        shapes = {t: _checked(header[t], t, file) for t in wanted}
        values = read_float_values(source.path / file, {t: header[t] for t in wanted})
        for tensor_name, (layer, kind, convention) in wanted.items():
            for part in ("k", "v") if kind == "kv" else (kind,):
                found.setdefault(convention, {}).setdefault(layer, {})[part] = shapes[tensor_name], values[tensor_name]
    return found


def _checked(entry: dict[str, Any], name: str, file: str) -> tuple[int, ...]:
    """The shape a scale of header `entry` reads as, [1] or [H, 1, 1]; anything else is an error naming it."""
    dtype, shape = entry["dtype"], entry["shape"]
    if dtype not in FLOAT_FORMATS:
        raise Fp8kvError(f"{file}: scale tensor {name} has dtype {_TORCH_SPELLING.get(dtype, dtype)}; "
                         "a KV scale must be a float")
    count = math.prod(shape) if all(isinstance(n, int) and not isinstance(n, bool) for n in shape) else -1
    if count == 1 and len(shape) <= 1:
        return (1,)
    if 1 <= count <= _MAX_HEADS and (len(shape) == 3 and shape[1:] == [1, 1] or len(shape) == 1):
        return count, 1, 1
    raise Fp8kvError(
        f"{file}: scale tensor {name} has shape {shape}; expected [] or [1] (per tensor) "
        "or [num_kv_heads, 1, 1] (per head)"
    )


def _vllm_json_scales(path: Path) -> tuple[dict[int, dict[str, Shaped]], str]:
    data = read_json(path)
    cache = data["kv_cache"]  # a dict: is_vllm_json checked it
    dtype = kv_dtype_from_file(str(cache.get("dtype", TORCH_DTYPE_NAME[DEFAULT_KV_DTYPE])))
    if dtype is None:
        raise Fp8kvError(f"{path}: kv_cache.dtype {cache.get('dtype')!r} is not an fp8 dtype fp8kv knows")
    ranks = cache["scaling_factor"]
    if not isinstance(ranks, dict) or not ranks:
        raise Fp8kvError(f"{path}: kv_cache.scaling_factor must map tensor-parallel rank -> layer -> scale")
    first = next(iter(ranks.values()))
    if any(r != first for r in ranks.values()):
        raise Fp8kvError(f"{path}: tensor-parallel ranks carry different scales; fp8kv expects one set")
    if not isinstance(first, dict) or not all(str(layer).isdigit() for layer in first):
        raise Fp8kvError(f"{path}: kv_cache.scaling_factor must map rank -> {{layer number: scale}}")
    exact = data.get("fp8kv") if isinstance(data.get("fp8kv"), dict) else {}
    exact_k, exact_v = (exact.get(key) if isinstance(exact.get(key), dict) else {} for key in ("k_scale", "v_scale"))
    table: dict[int, dict[str, Shaped]] = {}
    for layer, value in first.items():
        shared = _scalar(value, path, layer)
        k, v = exact_k.get(layer), exact_v.get(layer)
        if _number(k) and _number(v) and max(k, v) == value:  # exact K/V written by fp8kv
            table[int(layer)] = {"k": _scalar(k, path, layer), "v": _scalar(v, path, layer)}
        else:
            table[int(layer)] = {"k": shared, "v": shared, "shared": shared}
    return table, dtype


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar(value: Any, path: Path, layer: str) -> Shaped:
    if not _number(value):
        raise Fp8kvError(f"{path}: layer {layer} scale {value!r} is not a number")
    return (1,), (float32(float(value)),)


def _merge(found: dict[str, dict[int, dict[str, Shaped]]]) -> dict[int, dict[str, Shaped]]:
    """The union over conventions (in reading order); where two hold a layer, they must agree."""
    merged: dict[int, dict[str, Shaped]] = {}
    origin: dict[tuple[int, str], str] = {}
    for convention, layers in found.items():
        for layer, table in sorted(layers.items()):
            if "shared" in table:  # one value for K and V: compare with the larger of the two
                _agree_shared(merged.get(layer), table["shared"], layer, convention, origin)
            for kind in ("k", "v", "q"):
                if kind not in table:
                    continue
                if (layer, kind) in origin:
                    if "shared" not in table:
                        _agree(merged[layer][kind], table[kind], layer, kind, origin[(layer, kind)], convention)
                    continue
                merged.setdefault(layer, {})[kind] = table[kind]
                origin[(layer, kind)] = convention
    return merged


def _agree(a: Shaped, b: Shaped, layer: int, kind: str, first: str, second: str) -> None:
    close = all(x == y or abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a[1], b[1]))
    if a[0] != b[0] or not close:
        raise Fp8kvError(
            f"layer {layer}: {first} {kind}_scale {_show(a)} disagrees with {second} {kind}_scale {_show(b)}; "
            "remove one of them (fp8kv convert writes a single convention)"
        )


def _agree_shared(known: dict[str, Shaped] | None, shared: Shaped, layer: int, convention: str,
                  origin: dict[tuple[int, str], str]) -> None:
    if known and "k" in known and "v" in known:
        values = known["k"][1] + known["v"][1]
        larger = math.nan if any(map(math.isnan, values)) else max(values)  # a NaN never agrees
        _agree(((1,), (larger,)), shared, layer, "kv", origin[(layer, "k")] + " max(k,v)", convention)


def _show(scale: Shaped) -> str:
    values = list(scale[1])
    return repr(values[0]) if len(values) == 1 else repr(values)


def _kv_dtype(config: dict[str, Any]) -> str:
    qc = quantization_block(config)[1]
    if qc is not None and qc.get("quant_method") == "quark":
        spec = ((qc.get("layer_quant_config") or {}).get("*k_proj") or {}).get("output_tensors") or {}
        return kv_dtype_from_file(str(spec.get("dtype"))) or DEFAULT_KV_DTYPE
    return DEFAULT_KV_DTYPE
