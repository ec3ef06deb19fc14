"""Open and validate a source checkpoint folder without loading a single weight.

Only `config.json`, the safetensors index and the safetensors headers are read. Pickle
checkpoints (`*.bin`, `*.pt`, `*.pth`) are refused and never opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import PROVENANCE_FILE
from fp8kv.checkpoint.conventions import is_other_tower
from fp8kv.checkpoint.provenance import file_digest, read_provenance
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry, read_config, read_json

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# A safetensors header larger than this is not a checkpoint we should trust (real ones are < 10 MB).
MAX_HEADER_BYTES = 100 * 2**20
_HASH_CHUNK = 2**20


@dataclass(frozen=True)
class CheckpointLayout:
    """A checkpoint folder's files, config and safetensors headers, read without transformers (the digest
    card and push check needs no attention geometry)."""

    path: Path
    config: dict[str, Any]
    files: tuple[str, ...]
    weight_files: tuple[str, ...]
    headers: dict[str, dict[str, dict[str, Any]]]

    @classmethod
    def read(cls, path: str | Path) -> CheckpointLayout:
        """Read `path`'s config and safetensors headers (never the weights), checking the index and names."""
        root = Path(path)
        if not root.exists():
            raise Fp8kvError(f"{root}: no such checkpoint folder")
        if not root.is_dir():
            raise Fp8kvError(f"{root}: not a folder; pass the checkpoint folder holding config.json")
        root = root.resolve()
        files = _list_files(root)
        if not files:
            raise Fp8kvError(f"{root}: the folder is empty; expected config.json and *.safetensors")
        config = read_config(root)
        weight_files = _weight_files(root, files)
        headers = {name: read_safetensors_header(root / name) for name in weight_files}
        if INDEX_NAME in files:
            _check_index_tensors(root, headers)
        _check_unique_tensors(headers)
        return cls(root, config, files, weight_files, headers)


@dataclass(frozen=True)
class SourceCheckpoint:
    """A validated checkpoint folder: its config, geometry and safetensors layout.

    `files` are all regular files (relative POSIX paths, hidden folders skipped);
    `weight_files` the safetensors files the checkpoint loads; `headers[file]` maps
    tensor name -> {"dtype", "shape", "data_offsets"} as stored in that file.
    """

    path: Path
    config: dict[str, Any]
    geometry: AttentionGeometry
    files: tuple[str, ...]
    weight_files: tuple[str, ...]
    headers: dict[str, dict[str, dict[str, Any]]]

    @classmethod
    def open(cls, path: str | Path) -> SourceCheckpoint:
        """Validate `path` and read its config and safetensors headers (never the weights)."""
        layout = CheckpointLayout.read(path)
        root = layout.path
        geometry = _recorded_geometry(layout) or AttentionGeometry.from_config(layout.config,
                                                                              source=str(root / "config.json"))
        _check_projections(root, geometry, layout.headers)
        return cls(root, layout.config, geometry, layout.files, layout.weight_files, layout.headers)

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the weight file that holds it."""
        return {tensor: file for file, header in self.headers.items() for tensor in header}

    def content_hash(self) -> str:
        """sha256 over every file's relative path, size and sha256, in sorted order.

        A file in the Hugging Face cache that links to `blobs/<sha256>` (how the hub stores LFS
        files: weights) is named by its sha256 already; that name is used instead of reading it.
        """
        digest = hashlib.sha256()
        for name in sorted(self.files):
            encoded = name.encode()
            digest.update(len(encoded).to_bytes(8, "little") + encoded)
            path = self.path / name
            digest.update(path.stat().st_size.to_bytes(8, "little"))
            digest.update(file_sha256(path))
        return "sha256:" + digest.hexdigest()


def _recorded_geometry(layout: CheckpointLayout) -> AttentionGeometry | None:
    """The geometry fp8kv recorded in the fp8kv.json of a folder it wrote, while config.json is the file it wrote
    then; None for a foreign folder, an older record without it, or an edited config (transformers reads those)."""
    if PROVENANCE_FILE not in layout.files:
        return None
    try:
        record = read_provenance(layout.path)
    except Fp8kvError:  # a damaged record is reported by the commands that read it; the config still reads
        return None
    if record is None or record.geometry is None:
        return None
    written = dict(record.files or ()).get("config.json")
    return record.geometry if written == file_digest(layout.path / "config.json") else None


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file (without `__metadata__`), size-checked before reading."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise Fp8kvError(f"{path}: too short to be a safetensors file ({size} bytes)")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES:
            raise Fp8kvError(
                f"{path}: safetensors header claims {length} bytes, over the {MAX_HEADER_BYTES} byte bound; "
                "the file is corrupt or hostile"
            )
        if length > size - 8:
            raise Fp8kvError(
                f"{path}: safetensors header claims {length} bytes but the file has {size}; "
                "the file is truncated or not safetensors"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8kvError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise Fp8kvError(f"{path}: safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
    return header


# safetensors' float dtypes -> (struct code, bytes per value); a bf16 value is the high half of a float32's bytes.
FLOAT_FORMATS = {"F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "BF16": ("f", 2)}


def read_float_values(path: Path, entries: dict[str, dict[str, Any]]) -> dict[str, tuple[float, ...]]:
    """The values of the float tensors `entries` (name -> header entry) of the safetensors file `path`, read
    by their offsets without torch; for scales and other small tensors (the caller checks each shape first)."""
    values = {}
    with open(path, "rb") as handle:
        start = 8 + int.from_bytes(handle.read(8), "little")
        for name, entry in entries.items():
            dtype, count = entry["dtype"], math.prod(entry["shape"])
            code, size = FLOAT_FORMATS[dtype]
            begin, end = entry["data_offsets"]
            if end - begin != count * size:
                raise Fp8kvError(f"{path}: tensor {name!r} holds {end - begin} bytes, but {count} {dtype} values "
                                 f"take {count * size}; the file is corrupt")
            handle.seek(start + begin)
            raw = handle.read(end - begin)
            if dtype == "BF16":  # little-endian: two zero low bytes, then the stored high half
                raw = b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2))
            values[name] = struct.unpack(f"<{count}{code}", raw)
    return values


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("shape"), list)
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
    )
    if not ok:
        raise Fp8kvError(f"{path}: tensor {name!r} has a malformed header entry")
    begin, end = entry["data_offsets"]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size):
        raise Fp8kvError(f"{path}: tensor {name!r} points outside the file's data ({begin}..{end} of {data_size})")


def _list_files(root: Path) -> tuple[str, ...]:
    """Every regular file under `root` (hidden folders like .git or .cache skipped), symlinks checked."""
    names = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts[:-1]):
            continue
        if path.is_symlink():
            _check_link(root, path)
        if path.is_file():
            names.append(relative.as_posix())
    return tuple(names)


def _check_link(root: Path, path: Path) -> None:
    """Symlinks may point inside the folder, or into the blob store of a Hugging Face cache snapshot."""
    target = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev> -> ../../blobs
        allowed.append(root.parent.parent / "blobs")
    if not any(target.is_relative_to(base) for base in allowed):
        raise Fp8kvError(f"{path}: symlink points outside the checkpoint folder (to {target}); refusing it")


def _weight_files(root: Path, files: tuple[str, ...]) -> tuple[str, ...]:
    if INDEX_NAME in files:
        return _index_files(root, files)
    weights = tuple(name for name in files if name.endswith(".safetensors") and "/" not in name)
    if weights:
        return weights
    pickles = [name for name in files if name.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise Fp8kvError(
            f"{root}: only pickle weights found ({', '.join(pickles[:3])}); fp8kv never loads pickle files. "
            "Convert the checkpoint to safetensors first (save_pretrained(..., safe_serialization=True))"
        )
    raise Fp8kvError(f"{root}: no *.safetensors weight files found")


def _index_files(root: Path, files: tuple[str, ...]) -> tuple[str, ...]:
    index = _read_index(root / INDEX_NAME)
    names = sorted(set(index.values()))
    for name in names:
        if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts or "\\" in name:
            raise Fp8kvError(f"{root / INDEX_NAME}: weight file {name!r} escapes the checkpoint folder")
        if name not in files:
            raise Fp8kvError(f"{root / INDEX_NAME}: lists weight file {name!r}, which is missing")
        if not name.endswith(".safetensors"):
            raise Fp8kvError(f"{root / INDEX_NAME}: weight file {name!r} is not a .safetensors file")
    return tuple(names)


def _read_index(path: Path) -> dict[str, str]:
    weight_map = read_json(path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise Fp8kvError(f"{path}: needs a non-empty 'weight_map' object")
    bad = sorted(tensor for tensor, file in weight_map.items() if not isinstance(file, str))
    if bad:
        raise Fp8kvError(f"{path}: weight_map entry {bad[0]!r} must name a file, found {weight_map[bad[0]]!r}")
    return weight_map


def _check_index_tensors(root: Path, headers: dict[str, dict[str, Any]]) -> None:
    index = _read_index(root / INDEX_NAME)
    missing = sorted(t for t, file in index.items() if t not in headers[file])
    if missing:
        raise Fp8kvError(
            f"{root / INDEX_NAME}: {len(missing)} tensor(s) are not in the file the index names, "
            f"first {missing[0]!r}; the index does not match the weight files"
        )


_PROJECTION = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_proj\.weight$")


def _check_projections(root: Path, geometry: AttentionGeometry, headers: dict[str, dict[str, Any]]) -> None:
    """k/v_proj weights ([kv_heads * head_dim, hidden]) must have the rows the config's geometry implies.

    Only K and V, the tensors the cache stores: q_proj may carry more (gated attention's output gate).
    """
    for file, header in headers.items():
        for tensor, entry in header.items():
            match = _PROJECTION.search(tensor)
            if match is None or not entry["shape"] or is_other_tower(tensor):
                continue
            layer = int(match[1])
            if layer not in geometry.kv_layers:
                continue
            heads, head_dim = geometry.layer_kv_heads(layer), geometry.layer_head_dim(layer)
            if match[2] == "v" and geometry.v_head_dim is not None:
                head_dim = geometry.v_head_dim
            if entry["shape"][0] != heads * head_dim:
                raise Fp8kvError(
                    f"{root / 'config.json'}: {tensor} in {file} has {entry['shape'][0]} rows but the config's "
                    f"{heads} KV heads x head_dim {head_dim} need {heads * head_dim}; "
                    "the config does not match the weights"
                )


_BLOB_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> bytes:
    """The sha256 of a file's bytes: from its Hugging Face cache blob name when it has one, else read."""
    target = Path(os.readlink(path)) if path.is_symlink() else None
    if target is not None and target.parent.name == "blobs" and _BLOB_SHA256.fullmatch(target.name):
        return bytes.fromhex(target.name)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.digest()


def _check_unique_tensors(headers: dict[str, dict[str, Any]]) -> None:
    seen: dict[str, str] = {}
    for file, header in headers.items():
        for tensor in header:
            if tensor in seen:
                raise Fp8kvError(f"tensor {tensor!r} is stored twice, in {seen[tensor]} and {file}")
            seen[tensor] = file
