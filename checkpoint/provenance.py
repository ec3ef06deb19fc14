"""The provenance record (`fp8kv.json`): what calibrate measured and how, with its JSON round trip.

calibrate builds it, convert derives the converted folder's record from it, and inspect, verify and
the card read it back through `read_provenance`; no other module parses the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, is_fp8kv_output, read_artifact, write_file_atomic
from fp8kv.checkpoint.kvscales import float32
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.json_fields import checked, dataclass_from_json, json_object, typed


@dataclass(frozen=True)
class SourceRecord:
    """The source checkpoint: its folder, content hash (None on ranks that do not write) and Hub id."""

    path: str
    content_hash: str | None
    base_model: str | None


@dataclass(frozen=True)
class DatasetRecord:
    """The calibration text as it was read."""

    name: str
    split: str
    text_column: str
    num_samples: int
    num_tokens: int
    seq_len: int
    seed: int
    note: str | None
    # data.sample_digests of the samples read; empty in records written before fp8kv kept them
    sample_digests: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheRecord:
    """One of K or V in one layer; the per-head clip and scale only with --per-head."""

    amax: float
    clip: float  # the |x| the strategy mapped to MAX (the amax with strategy amax)
    scale: float  # the largest head's with --per-head
    saturation: float
    amax_per_head: tuple[float, ...]
    clip_per_head: tuple[float, ...] | None = None
    scale_per_head: tuple[float, ...] | None = None


@dataclass(frozen=True)
class LayerRecord:
    """One cache-owning layer: `scale_from_amax(k.clip, kv_dtype, headroom)` recomputes `k.scale` bit for bit."""

    layer: int
    headroom: float
    k: CacheRecord
    v: CacheRecord


@dataclass(frozen=True)
class QueryScaleRecord:
    """The query's amax and q_scale of one layer (calibrate --attention fp8)."""

    layer: int
    q_amax: float
    q_scale: float


@dataclass(frozen=True)
class ConvertedFrom:
    """The folder `fp8kv convert` read and the conventions its scales were in."""

    path: str
    conventions: tuple[str, ...]


@dataclass(frozen=True)
class Execution:
    """How the observation ran: `layerwise`, one decoder layer at a time; `processes`, the torchrun ranks
    (each observing its share of the batches); `device`, where the forward passes ran."""

    layerwise: bool
    processes: int
    device: str


@dataclass(frozen=True)
class MemoryRecord:
    """Scales observed on a model in memory (fp8kv.api), not on weights fp8kv loaded from `source.path`: the real
    tokens folded per cache layer (the most over layers), and whether the folder's weights were saved from that
    model (True) or linked from the source folder (False)."""

    num_tokens: int
    weights_saved: bool


@dataclass(frozen=True)
class Provenance:
    """The whole `fp8kv.json`. A record converted from a folder fp8kv did not calibrate carries only the
    tool, command, format, converted_from and no layers; the calibration fields are None there."""

    version: str
    command: str | None
    format: str
    layers: tuple[LayerRecord, ...] = ()
    tool: str = "fp8kv"
    source: SourceRecord | None = None
    dataset: DatasetRecord | None = None
    strategy: str | None = None
    headroom: float | None = None
    scale_formula: str | None = None
    kv_dtype: str | None = None
    fp8_max: float | None = None
    per_head: bool | None = None
    execution: Execution | None = None
    skipped_layers: tuple[int, ...] | None = None
    defaulted_layers: tuple[int, ...] | None = None
    query_scales: tuple[QueryScaleRecord, ...] | None = None
    converted_from: ConvertedFrom | None = None
    memory: MemoryRecord | None = None  # set when fp8kv.api observed a model in memory
    # The attention geometry fp8kv read from config.json when it wrote the folder: while config.json is still
    # the file it wrote (its digest in `files`), readers take it from here instead of through transformers.
    geometry: AttentionGeometry | None = None
    # Every file fp8kv wrote in the folder, relative POSIX name -> "sha256:<hex>", sorted; this file excluded.
    files: tuple[tuple[str, str], ...] | None = None

    def layer_map(self) -> dict[int, LayerRecord]:
        """layer index -> its record."""
        return {row.layer: row for row in self.layers}

    def layer_rows(self) -> list[dict[str, Any]]:
        """One row per layer for the per-layer table: amax, scale (per head with --per-head), saturation."""
        rows = []
        for row in self.layers:
            cells: dict[str, Any] = {"layer": row.layer}
            for name, cache in (("k", row.k), ("v", row.v)):
                cells |= {f"{name}_amax": cache.amax, f"{name}_scale": list(cache.scale_per_head or ()) or cache.scale,
                          f"{name}_saturation": cache.saturation}
            rows.append(cells)
        return rows

    def changed_scales(self, held: Mapping[int, tuple[Sequence[float], Sequence[float]]]
                       ) -> list[tuple[int, str, tuple[float, ...], tuple[float, ...]]]:
        """(layer, "k_scale" or "v_scale", held, recorded) for each scale whose float32 values are not the ones
        calibrate recorded; `held` maps a layer to its K and V scales as a file holds them (one or one per head)."""
        changed = []
        for row in self.layers:
            if row.layer not in held:
                continue
            for name, values, cache in zip(("k_scale", "v_scale"), held[row.layer], (row.k, row.v)):
                now, wrote = tuple(values), tuple(cache.scale_per_head or (cache.scale,))
                if len(now) != len(wrote) or any(float32(a) != float32(b) for a, b in zip(now, wrote)):
                    changed.append((row.layer, name, now, wrote))
        return changed

    def converted(self, version: str, command: str | None, convention: str, converted_from: ConvertedFrom) -> Provenance:
        """This record for the same scales rewritten in `convention` by `fp8kv convert`."""
        return replace(self, tool="fp8kv", version=version, command=command, format=convention,
                       converted_from=converted_from)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in the order fp8kv has always written them; absent sections left out."""
        values = {name: getattr(self, name) for name in _KEY_ORDER}
        out: dict[str, Any] = {}
        for name, value in values.items():
            if value is None and name != "command":  # command is recorded as null when unknown
                continue
            if name == "layers":
                out[name] = [_layer_to_dict(row) for row in value]
            elif name == "query_scales":
                out[name] = [_plain(row) for row in value]
            elif name == "files":
                out[name] = dict(value)
            else:
                out[name] = _plain(value)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str | Path = PROVENANCE_FILE) -> Provenance:
        """Parse what `to_json` wrote; one `Fp8kvError` naming `where` for anything else."""
        try:
            return _provenance_from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            detail = f"missing {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
            raise Fp8kvError(f"{where}: not an fp8kv provenance record ({detail}); "
                             "rerun the fp8kv command that wrote it") from None


def read_provenance(folder: str | Path) -> Provenance | None:
    """`folder/fp8kv.json`, or None when fp8kv did not write `folder`."""
    path = Path(folder) / PROVENANCE_FILE
    text = read_artifact(path)
    return None if text is None else Provenance.from_json(text, path)


def file_digest(path: Path) -> str:
    """"sha256:<hex>" of the bytes of `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def folder_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative POSIX names, links not followed, sorted), the provenance file excepted."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found += [(Path(root) / name).relative_to(folder).as_posix() for name in names]
    return sorted(name for name in found if name != PROVENANCE_FILE)


def record_written(*paths: Path) -> None:
    """Add files fp8kv just wrote (a report, a card) to the `files` of the fp8kv.json of the folder they
    belong to (theirs or its parent), so `--overwrite` knows them as fp8kv's; no record, no change."""
    for path in paths:
        path = Path(path).absolute()
        root = next((p for p in (path.parent, path.parent.parent) if is_fp8kv_output(p)), None)
        record = read_provenance(root) if root is not None else None
        if record is None:
            continue
        files = dict(record.files or ())
        files[path.relative_to(root).as_posix()] = file_digest(path)
        updated = replace(record, files=tuple(sorted(files.items())))
        write_file_atomic(root / PROVENANCE_FILE, updated.to_json().encode())


def unrecorded_files(folder: Path, compare_bytes: bool = True) -> tuple[list[str], list[str]]:
    """(files fp8kv did not write, files it wrote that changed since) in `folder`, each sorted.

    Names are compared first, so a folder of foreign files is refused without reading any bytes;
    without `compare_bytes` the second list stays empty.
    """
    record = read_provenance(folder)
    recorded = dict(record.files or ()) if record is not None else {}
    present = folder_files(folder)
    foreign = [name for name in present if name not in recorded]
    if foreign or not compare_bytes:
        return foreign, []
    return [], [name for name in present if file_digest(folder / name) != recorded[name]]


_HASH_CHUNK = 2**24

# The file's key order: calibration settings first, per-layer results, then what convert adds.
_KEY_ORDER = ("tool", "version", "command", "source", "dataset", "strategy", "headroom", "scale_formula", "kv_dtype",
              "fp8_max", "per_head", "format", "execution", "memory", "skipped_layers", "defaulted_layers", "layers",
              "query_scales", "converted_from", "geometry", "files")


def _plain(value: Any) -> Any:
    """A nested record as a JSON value: dataclasses as objects in field order, tuples as lists."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _layer_to_dict(row: LayerRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": row.layer, "headroom": row.headroom}
    for name, cache in (("k", row.k), ("v", row.v)):
        for f in fields(cache):
            value = getattr(cache, f.name)
            if value is not None:
                out[f"{name}_{f.name}"] = _plain(value)
    return out


def _provenance_from_dict(data: Any) -> Provenance:
    data = json_object(data, "the record")
    required = {"version": _text(data, "version"), "command": _text(data, "command", True),
                "format": _text(data, "format"), "tool": _text(data, "tool")}
    optional = {
        "source": lambda d: SourceRecord(_text(d, "path"), _text(d, "content_hash", True),
                                         _text(d, "base_model", True)),
        "dataset": lambda d: DatasetRecord(_text(d, "name"), _text(d, "split"), _text(d, "text_column"),
                                           _integer(d, "num_samples"), _integer(d, "num_tokens"),
                                           _integer(d, "seq_len"), _integer(d, "seed"), _text(d, "note", True),
                                           _each(d, "sample_digests", str) if "sample_digests" in d else ()),
        "execution": lambda d: Execution(typed(d, "layerwise", bool), _integer(d, "processes"), _text(d, "device")),
        "converted_from": lambda d: ConvertedFrom(_text(d, "path"), _each(d, "conventions", str)),
        "memory": lambda d: MemoryRecord(_integer(d, "num_tokens"), typed(d, "weights_saved", bool)),
    }
    values: dict[str, Any] = {name: parse(json_object(data[name], name)) for name, parse in optional.items()
                              if data.get(name) is not None}
    for name in ("strategy", "scale_formula", "kv_dtype"):
        values[name] = _text(data, name, True)
    for name in ("headroom", "fp8_max"):
        values[name] = _number(data, name, True)
    values["per_head"] = typed(data, "per_head", bool, True)
    for name in ("skipped_layers", "defaulted_layers"):
        if data.get(name) is not None:
            values[name] = _each(data, name, int)
    if data.get("query_scales") is not None:
        values["query_scales"] = tuple(QueryScaleRecord(_integer(q, "layer"), _number(q, "q_amax"),
                                                        _number(q, "q_scale"))
                                       for q in map(json_object, typed(data, "query_scales", list)))
    if data.get("geometry") is not None:
        values["geometry"] = _geometry(data["geometry"])
    if data.get("files") is not None:
        values["files"] = tuple(sorted((name, checked(digest, str, f"the digest of {name!r}"))
                                       for name, digest in json_object(data["files"], "files").items()))
    layers = tuple(_layer_from_dict(json_object(row, "a layer row")) for row in typed(data, "layers", list))
    return Provenance(**required, layers=layers, **values)


def _layer_from_dict(row: dict[str, Any]) -> LayerRecord:
    layer = _integer(row, "layer")

    def cache(name: str) -> CacheRecord:
        per_head = {part: _numbers(row, f"{name}_{part}_per_head", optional=part != "amax")
                    for part in ("amax", "clip", "scale")}
        return CacheRecord(_number(row, f"{name}_amax"), _number(row, f"{name}_clip"), _number(row, f"{name}_scale"),
                           _number(row, f"{name}_saturation"), per_head["amax"], per_head["clip"], per_head["scale"])

    try:
        return LayerRecord(layer, _number(row, "headroom"), cache("k"), cache("v"))
    except KeyError as exc:
        raise ValueError(f"missing {exc.args[0]!r} in layer {layer}") from None


def _geometry(data: Any) -> AttentionGeometry:
    """The recorded geometry, refused (ValueError) when its per-layer facts contradict its layer count."""
    geometry = dataclass_from_json(AttentionGeometry, data, "geometry")
    n = geometry.num_layers
    per_layer = (geometry.layer_types, geometry.kv_heads_per_layer or (1,) * n, geometry.head_dim_per_layer or (1,) * n)
    sizes = (n, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, *per_layer[1], *per_layer[2])
    if (min(sizes, default=0) < 1 or any(len(column) != n for column in per_layer) or not geometry.kv_layers
            or not set(geometry.kv_layers) <= set(range(n))):
        raise ValueError("its geometry contradicts its layer count")
    return geometry


def _each(data: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> tuple[Any, ...]:
    return tuple(checked(value, kind, f"an item of {key!r}") for value in typed(data, key, list))


def _text(data: dict[str, Any], key: str, optional: bool = False) -> str | None:
    return typed(data, key, str, optional)


def _integer(data: dict[str, Any], key: str) -> int:
    return typed(data, key, int)


def _number(data: dict[str, Any], key: str, optional: bool = False) -> float | None:
    value = typed(data, key, (int, float), optional)
    return None if value is None else float(value)


def _numbers(data: dict[str, Any], key: str, optional: bool = False) -> tuple[float, ...] | None:
    if optional and data.get(key) is None:
        return None
    return tuple(float(x) for x in _each(data, key, (int, float)))
