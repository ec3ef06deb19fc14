"""What SGLang's published wheels pin and load for fp8 KV scales, read from the wheels themselves (no install).

Downloads each release's wheel from the package index (`pip download --no-deps`) and records, from its own files,
what decides fp8kv's `sglang@VERSION` engine models:

- the torch its METADATA pins, and from that whether its bf16 -> float8_e4m3fn cast saturates;
- whether its compressed-tensors config gives RadixAttention a KV-cache quant method, the only path on which the
  checkpoint's kv_cache_scheme scales are loaded.

    .venv/bin/python probes/probe_sglang_packages.py          # rewrites tests/golden/sglang-releases.json

What SGLang's loader then holds is run, not read, for one release: probes/probe_sglang.py.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "tests" / "golden" / "sglang-releases.json"
RELEASES = ("0.5.1", "0.5.5", "0.5.10", "0.5.12", "0.5.13", "0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
            "0.5.20", "0.5.21", "0.5.22", "0.5.23")
CONFIG = "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
# torch 2.12 is the first whose CPU eager cast saturates (sglang-0.5.23.json measures the pin of 0.5.23)
SATURATING_TORCH = (2, 12)
PROVENANCE = {
    "source": "the package index, wheels fetched without dependencies and read, not installed",
    "command": "probes/probe_sglang_packages.py: python -m pip download --no-deps sglang==VERSION -d TMP/VERSION; "
               "then read the wheel's *.dist-info/METADATA (Requires-Dist: torch, Requires-Python) and " + CONFIG,
    "built": "the newest timestamp of the wheel's METADATA entry (the build, not the upload date)",
    "pinned_torch_saturates": "derived from the pin, not run per release: torch >= 2.12 saturates bf16 -> "
                              "float8_e4m3fn on CPU eager (2.14.1 measured in sglang-0.5.23.json), torch 2.11 and "
                              "older give NaN past 464",
}
NOT_LOADED = ("the compressed-tensors config gives RadixAttention no quant method, so no k_scale/v_scale parameter "
              "exists; the legacy loader drops the checkpoint's scale tensors and the cache runs at 1.0")


class Package:
    """One downloaded wheel: its METADATA and Python files by their path inside the wheel."""

    def __init__(self, path: Path) -> None:
        self.path, self.sha256 = path, hashlib.sha256(path.read_bytes()).hexdigest()
        with zipfile.ZipFile(path) as archive:
            meta = next(i for i in archive.infolist() if i.filename.endswith(".dist-info/METADATA"))
            self.metadata = archive.read(meta).decode("utf-8")
            self.built = datetime(*meta.date_time).strftime("%Y-%m-%d")
            self._files = {name: archive.read(name) for name in archive.namelist() if name.endswith(".py")}

    def text(self, name: str) -> str:
        if name not in self._files:
            raise SystemExit(f"{self.path.name} has no {name}")
        return self._files[name].decode("utf-8")

    def field(self, name: str) -> list[str]:
        """The METADATA's values of one field, in the file's order."""
        return [line.split(":", 1)[1].strip() for line in self.metadata.splitlines() if line.startswith(f"{name}:")]


def download(version: str, into: Path) -> Package:
    folder = into / version
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={version}", "-d",
                    str(folder)], check=True, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    return Package(next(folder.iterdir()))


def torch_pin(package: Package) -> str:
    # the first in the file's order: 0.5.1 pins torch only under extras, "srt" (the server runtime) first
    pins = [r for r in package.field("Requires-Dist") if re.match(r"torch\s*==", r)]
    if not pins:
        raise SystemExit(f"{package.path.name} pins no torch")
    return pins[0]


def saturates(pin: str) -> bool:
    major, minor = (int(part) for part in re.match(r"torch\s*==\s*(\d+)\.(\d+)", pin).groups())
    return (major, minor) >= SATURATING_TORCH


def _isinstance_of(test: ast.expr) -> str | None:
    """X in `isinstance(layer, X)`."""
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"
            and len(test.args) == 2):
        return ast.unparse(test.args[1])
    return None


def _returned(branch: ast.If) -> list[ast.Return]:
    """The returns under a branch that give something other than None."""
    return [node for stmt in branch.body for node in ast.walk(stmt) if isinstance(node, ast.Return)
            and node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None)]


def kv_scales_evidence(package: Package) -> tuple[bool, dict]:
    """Whether get_quant_method gives RadixAttention a KV-cache method, and the line that shows it: that return,
    or else where kv_cache_scheme is only stored."""
    source = package.text(CONFIG)
    lines = source.splitlines()
    config = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
                  and any(isinstance(f, ast.FunctionDef) and f.name == "get_quant_method" for f in node.body))
    method = next(f for f in config.body if isinstance(f, ast.FunctionDef) and f.name == "get_quant_method")
    given = [(_isinstance_of(node.test), node) for node in ast.walk(method) if isinstance(node, ast.If)
             and _isinstance_of(node.test) and _returned(node)]
    for layer, branch in given:
        kv = [r for r in _returned(branch) if isinstance(r.value, ast.Call)
              and ast.unparse(r.value.func).endswith("KVCacheMethod")]
        if layer == "RadixAttention" and kv:
            return True, {"file": CONFIG, "line": kv[0].lineno, "text": lines[kv[0].lineno - 1].strip(),
                          "context": f"{config.name}.get_quant_method, isinstance(layer, RadixAttention) branch"}
    stored = next(node for node in ast.walk(config) if isinstance(node, ast.Assign)
                  and any(ast.unparse(t) == "self.kv_cache_scheme" for t in node.targets))
    gives = ", ".join(f"{layer} (line {branch.lineno})" for layer, branch in sorted(given, key=lambda g: g[1].lineno))
    return False, {"file": CONFIG, "line": stored.lineno, "text": lines[stored.lineno - 1].strip(),
                   "context": f"kv_cache_scheme stored only; get_quant_method gives a quant method to {gives}, "
                              "none to RadixAttention"}


def release(version: str, package: Package) -> dict:
    pin = torch_pin(package)
    loads, evidence = kv_scales_evidence(package)
    return {"version": version, "wheel": package.path.name, "wheel_sha256": package.sha256, "built": package.built,
            "requires_python": package.field("Requires-Python")[0], "torch_pin": pin,
            "pinned_torch_saturates": saturates(pin), "loads_compressed_tensors_kv_scales": loads,
            "evidence": evidence}


def first(rows: list[dict], key: str) -> tuple[dict, str]:
    """The first release (in RELEASES' order) where `key` holds, and the one checked before it."""
    index = next((i for i, row in enumerate(rows) if row[key]), None)
    if index is None:
        raise SystemExit(f"{key} holds in no release probed")
    if index == 0:
        raise SystemExit(f"{key} already holds in {rows[0]['version']}: probe an older release")
    return rows[index], rows[index - 1]["version"]


def dump(record: dict) -> str:
    """Indented JSON with each release on one line, so a new release is one more line in the diff."""
    parts = [f" {json.dumps(key)}: {json.dumps(value, indent=1).replace(chr(10), chr(10) + ' ')}"
             for key, value in record.items() if key != "releases"]
    parts.append(' "releases": [\n' + ",\n".join(f"  {json.dumps(row)}" for row in record["releases"]) + "\n ]")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN)
    args = parser.parse_args()
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [release(v, download(v, Path(tmp))) for v in RELEASES]
    saturating, before_saturating = first(rows, "pinned_torch_saturates")
    loading, before_loading = first(rows, "loads_compressed_tensors_kv_scales")
    record = {
        "engine": "sglang",
        "provenance": {"source": PROVENANCE["source"], "command": PROVENANCE["command"],
                       "pip": " ".join(pip.stdout.split()[:2]),
                       "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "built": PROVENANCE["built"], "pinned_torch_saturates": PROVENANCE["pinned_torch_saturates"]},
        "first_pinning_torch_2_12_or_later": {"version": saturating["version"], "torch_pin": saturating["torch_pin"],
                                              "previous_checked": before_saturating},
        "first_loading_compressed_tensors_kv_scales": {"version": loading["version"],
                                                       "previous_checked": before_loading, "before": NOT_LOADED},
        "releases": rows,
    }
    partial = args.out.with_suffix(".json.partial")
    partial.write_text(dump(record), encoding="utf-8")
    partial.replace(args.out)
    for row in rows:
        print(f"sglang {row['version']:>7}: {row['torch_pin']}, saturates: {row['pinned_torch_saturates']}; "
              f"loads compressed-tensors KV scales: {row['loads_compressed_tensors_kv_scales']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
