"""Write a checkpoint with KV scales, atomically, without rewriting the source's weight bytes.

Overlay mode hard-links the source weight files (copying where a link is impossible) and adds
one small scales file; copy mode writes real copies. A weight file that already holds KV-scale
tensors is rewritten without them by copying its raw byte ranges under a new header.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import torch
from safetensors.torch import save

from fp8kv import __version__
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE, check_writable_location, describes_source_only
from fp8kv.checkpoint.provenance import Provenance, file_digest, folder_files, unrecorded_files
from fp8kv.checkpoint.conventions import (
    COMPRESSION_CONFIG, CONVENTIONS, HF_QUANT_CONFIG, QUANTIZATION_CONFIG, SCALES_FILE, VLLM_JSON_FILE, QuantConfigs,
    attention_modules, check_method, is_vllm_json, parse_scale_name, quant_configs, query_scale_name, scale_convention,
    scale_names, vllm_json,
)
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.nvfp4 import NVFP4_ONLY
from fp8kv.checkpoint.source import INDEX_NAME, SourceCheckpoint, read_safetensors_header
from fp8kv.checkpoint.latent import check_latent_convention
from fp8kv.geometry import read_json
from fp8kv.errors import Fp8kvError
from fp8kv.options import DEFAULT_MODE, WriteMode

MODES = get_args(WriteMode)
# Files at most this big are copied even in overlay mode, so editing the output never edits the source.
_LINK_MIN_BYTES = 16 * 2**20
_COPY_CHUNK = 16 * 2**20
_SINGLE_FILE = "model.safetensors"


def write_checkpoint(
    source_dir: str | Path,
    out_dir: str | Path,
    scales: KVScales,
    *,
    convention: str = "compressed-tensors",
    mode: str = DEFAULT_MODE,
    overwrite: bool = False,
    record: Provenance | None = None,
) -> Path:
    """Write `source_dir` plus `scales` in `convention` to `out_dir`, atomically; return `out_dir`.

    The source is never modified. Scale values are written exactly as given (float32). The source's
    provenance, verify report, fp8kv card and evaluation results are left behind: they describe it.
    `record` becomes the output's fp8kv.json, listing every file written with its digest: `overwrite`
    replaces a folder only when it holds those files alone, unchanged.
    """
    if convention not in CONVENTIONS + NVFP4_ONLY:
        raise Fp8kvError(f"unknown format {convention!r}; choose one of {', '.join(CONVENTIONS + NVFP4_ONLY)}")
    if mode not in MODES:
        raise Fp8kvError(f"unknown mode {mode!r}; choose overlay or copy")
    source = SourceCheckpoint.open(source_dir)
    check_latent_convention(source.geometry, convention, scales.strategy, str(source.path / "config.json"))
    check_scales_fit(source, scales)
    out = check_output(source.path, Path(out_dir), overwrite)
    _make_parent(out)
    blocks = quant_configs(convention, source.config, _hf_quant(source), scales, __version__)
    _clean_stale(out)
    tmp = out.parent / f".{out.name}.fp8kv-tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        _fill(tmp, source, scales, convention, mode, blocks)
        if record is not None:
            files = tuple((name, file_digest(tmp / name)) for name in folder_files(tmp))
            (tmp / PROVENANCE_FILE).unlink(missing_ok=True)  # never write through a hard link into the source
            _write_bytes(tmp / PROVENANCE_FILE, replace(record, files=files, geometry=source.geometry).to_json().encode())
        _fsync_dir(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_scales_fit(source: SourceCheckpoint, scales: KVScales) -> None:
    """Scales must cover exactly the cache-owning layers, with one value per KV head for attn_head."""
    geometry = source.geometry
    missing = sorted(set(geometry.kv_layers) - set(scales.layers))
    extra = sorted(set(scales.layers) - set(geometry.kv_layers))
    if missing or extra:
        raise Fp8kvError(
            f"{source.path}: scales do not match the layers that own a KV cache {list(geometry.kv_layers)}"
            f" (missing {missing}, unexpected {extra})"
        )
    shape = scales.shape
    if scales.strategy == "attn_head" and shape != (geometry.num_kv_heads, 1, 1):
        raise Fp8kvError(
            f"{source.path}: per-head scales have shape {list(shape)}, expected [{geometry.num_kv_heads}, 1, 1]"
        )


def check_weight_method(convention: str, source: SourceCheckpoint) -> None:
    """Refuse, before any work, a convention the engines of the source's weight quantization do not read."""
    check_method(convention, source.config, _hf_quant(source))


def _hf_quant(source: SourceCheckpoint) -> dict[str, Any] | None:
    return read_json(source.path / HF_QUANT_CONFIG) if HF_QUANT_CONFIG in source.files else None


def check_output(source: Path, out: Path, overwrite: bool) -> Path:
    """Refuse an output path that cannot be written, before any slow work; returns it absolute.

    Creates nothing, so a refused run leaves the disk as it was (an output a killed run had moved aside goes back
    in place first).
    """
    out = out.absolute()
    if out.parent.is_dir():
        _restore_moved_aside(out)
    resolved = out.resolve()
    if resolved == source or resolved.is_relative_to(source):
        raise Fp8kvError(f"{out}: the output folder must not be inside the source checkpoint {source}")
    if source.is_relative_to(resolved):
        raise Fp8kvError(f"{out}: the output folder contains the source checkpoint {source}; choose another")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise Fp8kvError(f"{out}: exists and is not a folder; choose another output path")
        foreign, modified = unrecorded_files(out, compare_bytes=overwrite)
        if foreign or modified:
            raise Fp8kvError(f"{out}: {_not_fp8kvs(foreign, modified)}; --overwrite replaces only what fp8kv "
                             "wrote there, unchanged: choose another --out, or move those files out first")
        if not overwrite:
            raise Fp8kvError(f"{out}: already exists; pass --overwrite to replace it")
    check_writable_location(out)
    return out


def _not_fp8kvs(foreign: list[str], modified: list[str]) -> str:
    """`foreign` and `modified` file names as one phrase, at most five of each named."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = ([f"holds files fp8kv did not write ({some(foreign)})"] if foreign else []) + \
        ([f"holds files fp8kv wrote that were changed since ({some(modified)})"] if modified else [])
    return " and ".join(parts)


def _make_parent(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # read-only file system, no permission
        raise Fp8kvError(f"{out}: cannot create the output folder ({exc.strerror}: {exc.filename})") from None


def _fill(tmp: Path, source: SourceCheckpoint, scales: KVScales, convention: str, mode: str,
          blocks: QuantConfigs) -> None:
    adds_file = convention != "vllm-json"
    weight_map: dict[str, str] = {}
    for name in source.files:
        if _regenerated(source, name) or describes_source_only(source.path, name):
            continue
        if name not in source.weight_files:
            _carry(source.path / name, tmp / name, mode)
            continue
        header = source.headers[name]
        keep = [t for t in header if parse_scale_name(t) is None]
        if not keep:
            continue  # a file of old scales only, replaced by the new scales
        target = "model-00001-of-00001.safetensors" if adds_file and name == _SINGLE_FILE else name
        if len(keep) == len(header):
            _carry(source.path / name, tmp / target, mode, link_any_size=True)
        else:
            _copy_without(source.path / name, tmp / target, header, keep)
        weight_map.update(dict.fromkeys(keep, target))
    if adds_file:
        weight_map.update(_write_scales(tmp / SCALES_FILE, source, scales, convention))
    else:
        _write_json(tmp / VLLM_JSON_FILE, vllm_json(scales, source.geometry.model_type))
    if adds_file or INDEX_NAME in source.files:
        _write_index(tmp, weight_map)
    config = {key: value for key, value in source.config.items()
              if key not in (QUANTIZATION_CONFIG, COMPRESSION_CONFIG)}  # the old block, wherever it was
    if blocks.block is not None:
        config[blocks.key] = blocks.block
    _write_json(tmp / "config.json", config)
    if blocks.hf_quant is not None:
        _write_json(tmp / HF_QUANT_CONFIG, blocks.hf_quant)


def _regenerated(source: SourceCheckpoint, name: str) -> bool:
    """Files the writer produces itself, and old scale files another convention left behind."""
    if name in ("config.json", INDEX_NAME, HF_QUANT_CONFIG, VLLM_JSON_FILE):
        return True
    return name.endswith(".json") and "/" not in name and is_vllm_json(source.path / name)


def _write_scales(path: Path, source: SourceCheckpoint, scales: KVScales, convention: str) -> dict[str, str]:
    modules = attention_modules(list(source.weight_map), scales.layers)
    model_type = source.geometry.model_type
    tensors: dict[str, torch.Tensor] = {}
    for layer in scales.layers:
        k_name, v_name = scale_names(convention, modules[layer], model_type)
        k, v = scales.tensor("k", layer), scales.tensor("v", layer)
        if scale_convention(convention).zero_dim:
            k, v = k.reshape(()), v.reshape(())
        tensors[k_name], tensors[v_name] = k.contiguous(), v.contiguous()
        if scales.q is not None:
            tensors[query_scale_name(modules[layer], model_type)] = scales.tensor("q", layer)
    # Serialized in memory and written like every other file (safetensors' save_file creates it 0600).
    _write_bytes(path, save(tensors, metadata={"format": "pt"}))
    return dict.fromkeys(tensors, SCALES_FILE)


def _write_index(tmp: Path, weight_map: dict[str, str]) -> None:
    total = 0
    for file in set(weight_map.values()):
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in read_safetensors_header(tmp / file).values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(tmp / INDEX_NAME, index)


def _copy_without(src: Path, dst: Path, header: dict[str, dict[str, Any]], keep: list[str]) -> None:
    """Rewrite a safetensors file without some tensors by copying raw byte ranges (no deserialising)."""
    with open(src, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        metadata = json.loads(handle.read(length)).get("__metadata__")
    data_start = 8 + length
    new_header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(keep, key=lambda t: header[t]["data_offsets"][0]):
        begin, end = header[name]["data_offsets"]
        new_header[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    raw = json.dumps(new_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    with open(src, "rb") as inp, open(dst, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for name in sorted(keep, key=lambda t: header[t]["data_offsets"][0]):
            begin, end = header[name]["data_offsets"]
            inp.seek(data_start + begin)
            _copy_range(inp, out, end - begin)
        out.flush()
        os.fsync(out.fileno())


def _copy_range(inp, out, size: int) -> None:
    while size > 0:
        chunk = inp.read(min(size, _COPY_CHUNK))
        if not chunk:
            raise Fp8kvError(f"{inp.name}: ends early; the file is truncated")
        out.write(chunk)
        size -= len(chunk)


def _carry(src: Path, dst: Path, mode: str, link_any_size: bool = False) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if mode == "overlay" and (link_any_size or src.stat().st_size >= _LINK_MIN_BYTES):
        try:
            os.link(src, dst)
            return
        except OSError:  # another device, no hard links on this file system, link limit reached
            pass
    shutil.copyfile(src, dst)
    _fsync_file(dst)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(root: Path) -> None:
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        _fsync_dir_only(folder)


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        _fsync_dir_only(out.parent)
        return
    old = out.parent / f".{out.name}.fp8kv-old-{os.getpid()}"
    try:
        os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:  # Ctrl-C between the two renames: the old output goes back in place
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    _fsync_dir_only(out.parent)
    shutil.rmtree(old)


def _fsync_dir_only(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clean_stale(out: Path) -> None:
    """Remove temp and old folders that killed runs left next to `out` (their process is gone)."""
    for kind in ("tmp", "old"):
        for path in _stale(out, kind):
            shutil.rmtree(path, ignore_errors=True)


def _restore_moved_aside(out: Path) -> None:
    """Put back the output a run killed between its two renames had moved aside, when nothing took its place."""
    for path in _stale(out, "old"):
        if not (out.exists() or out.is_symlink()):
            os.rename(path, out)


def _stale(out: Path, kind: str) -> list[Path]:
    """The `kind` ("tmp" or "old") folders next to `out` of runs that are gone (or of this one)."""
    found = []
    for path in out.parent.glob(f".{out.name}.fp8kv-{kind}-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
