"""A digest of exactly what verify judges: the scales, the config's quantization block, the weight files.

verify records it in its report; `card` and `push` recompute it and refuse a report whose digest
differs, naming what changed, so a verdict never travels to scales it did not see.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.conventions import (
    COMPRESSION_CONFIG, HF_QUANT_CONFIG, QUANTIZATION_CONFIG, is_vllm_json, parse_scale_name,
)
from fp8kv.checkpoint.artifacts import VERIFY_DIR
from fp8kv.checkpoint.locate import verify_command
from fp8kv.checkpoint.source import CheckpointLayout
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import read_json


@dataclass(frozen=True)
class CheckpointDigest:
    """`scales`: scale tensor (or legacy scale file) -> sha256 of dtype, shape and bytes;
    `quantization`: sha256 of `quantization_config`, `compression_config` and `hf_quant_config.json`;
    `weights`: weight file -> size in bytes."""

    scales: dict[str, str]
    quantization: str
    weights: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"scales": dict(sorted(self.scales.items())), "quantization": self.quantization,
                "weights": dict(sorted(self.weights.items()))}

    @classmethod
    def from_json(cls, data: Any, where: str) -> CheckpointDigest:
        """Parse what `to_json` wrote; `Fp8kvError` naming `where` for anything else."""
        ok = (isinstance(data, dict) and isinstance(data.get("scales"), dict)
              and isinstance(data.get("quantization"), str) and isinstance(data.get("weights"), dict))
        if not ok:
            folder = Path(where).parent.parent  # where verify writes a folder's report: FOLDER/verify/report.json
            again = f"`{verify_command(folder)}`" if Path(where).parent.name == VERIFY_DIR else "`fp8kv verify` on this folder"
            raise Fp8kvError(f"{where}: has no valid checkpoint digest; run {again} again")
        return cls(dict(data["scales"]), data["quantization"], dict(data["weights"]))

    def changes(self, now: CheckpointDigest) -> list[str]:
        """What differs in `now`, one short phrase each, sorted; empty when nothing did."""
        found = _dict_changes("scale", self.scales, now.scales)
        found += _dict_changes("weight file", self.weights, now.weights)
        if self.quantization != now.quantization:
            found.append("the config's quantization block changed")
        return found


def checkpoint_digest(folder: str | Path) -> CheckpointDigest:
    """The digest of `folder` as it is on disk now (reads headers, scale bytes and configs only)."""
    source = CheckpointLayout.read(folder)
    scales: dict[str, str] = {}
    for file, header in source.headers.items():
        for tensor, entry in header.items():
            if parse_scale_name(tensor) is not None:
                scales[tensor] = _tensor_hash(source.path / file, entry)
    for name in source.files:
        if name.endswith(".json") and "/" not in name and is_vllm_json(source.path / name):
            scales[name] = "sha256:" + hashlib.sha256((source.path / name).read_bytes()).hexdigest()
    hf_quant = read_json(source.path / HF_QUANT_CONFIG) if HF_QUANT_CONFIG in source.files else None
    blocks = [source.config.get(QUANTIZATION_CONFIG), source.config.get(COMPRESSION_CONFIG), hf_quant]
    block = json.dumps(blocks, sort_keys=True)
    weights = {name: (source.path / name).stat().st_size for name in source.weight_files}
    return CheckpointDigest(scales, "sha256:" + hashlib.sha256(block.encode()).hexdigest(), weights)


def check_unchanged(folder: Path, recorded: CheckpointDigest, report_path: Path) -> None:
    """Refuse (`Fp8kvError`) a report whose recorded digest does not match `folder` now."""
    changes = recorded.changes(checkpoint_digest(folder))
    if changes:
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise Fp8kvError(f"{report_path}: judged other files than {folder} holds now ({shown}); "
                         f"run `{verify_command(folder)}` again")


def _tensor_hash(path: Path, entry: dict[str, Any]) -> str:
    with open(path, "rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
        begin, end = entry["data_offsets"]
        handle.seek(data_start + begin)
        raw = handle.read(end - begin)
    digest = hashlib.sha256(f"{entry['dtype']}{entry['shape']}".encode() + raw)
    return "sha256:" + digest.hexdigest()


def _dict_changes(kind: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = [f"{kind} {name} is new" for name in sorted(set(after) - set(before))]
    found += [f"{kind} {name} is gone" for name in sorted(set(before) - set(after))]
    found += [f"{kind} {name} changed" for name in sorted(set(before) & set(after)) if before[name] != after[name]]
    return found
