"""Record which KV scales SGLang's own loader holds for each fp8kv output format: tests/golden/sglang-VERSION.json.

Runs in fp8kv's venv; SGLang runs in its own (probes/sglang_venv.sh builds bench/.sglang-venv):

    .venv/bin/python probes/probe_sglang.py [--sglang-python bench/.sglang-venv/bin/python] [--out FILE]

It writes a tiny llama checkpoint (tools/factory.py), calibrates it with `fp8kv calibrate` on the bundled corpus,
converts the result with `fp8kv convert --to modelopt` and `--to vllm-json`, and makes two negative controls (the
calibrated folder with its scale tensors removed, and the uncalibrated source). Each folder goes through
loadcheck/probes/sglang.py in SGLang's python, with the flags each format needs and once more under
`SGLANG_ENABLE_WEIGHT_LOADER_V2=1`; every layer's held k/v scale is compared with the file's
(`fp8kv inspect DIR --json`). The cast facts of SGLang's torch (does bf16 -> fp8 saturate?) are recorded beside.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "loadcheck" / "probes" / "sglang.py"
DEFAULT_SGLANG_PYTHON = ROOT / "bench" / ".sglang-venv" / "bin" / "python"
CALIBRATE_ARGS = ["--dataset", "bundled", "--num-samples", "8", "--seq-len", "128", "--seed", "42"]
MODEL = {"arch": "llama", "num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "dtype": "bfloat16"}
V2_ENV = {"SGLANG_ENABLE_WEIGHT_LOADER_V2": "1"}

# Read in SGLang 0.5.23's source, not run: what the held values feed (a forward pass needs CUDA kernels).
SOURCE_NOTES = [
    "Only BaseKVCacheMethod.process_weights_after_loading sets k_scale_float/v_scale_float; a "
    "--quantization-param-path file assigns RadixAttention.k_scale/v_scale as Python floats and leaves *_float "
    "None.",
    "flashinfer_backend passes layer.k_scale_float/v_scale_float to its attention kernels and writes the cache "
    "with layer.k_scale/v_scale (_kv_write_scales); flashattention_backend calls layer.k_scale.expand(...), which "
    "a Python float does not have.",
]

# bf16 inputs around and past each fp8 format's range; torch 2.11 and older give NaN for e4m3 past 464.
CAST_SCRIPT = r"""
import json, platform, torch
inputs = [465.0, 1000.0, float("inf"), -465.0]
out = {"python": platform.python_version(), "torch": torch.__version__, "input_bf16": ["inf" if v == float("inf")
       else v for v in inputs]}
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    cast = torch.tensor(inputs, dtype=torch.bfloat16).to(dtype)
    out[str(dtype).split(".")[-1]] = {"bytes": ["0x%02x" % b for b in cast.view(torch.uint8).tolist()],
                                      "values": [repr(v) for v in cast.float().tolist()]}
print(json.dumps(out))
"""


def fp8kv_command() -> list[str]:
    """fp8kv's CLI from this venv."""
    script = Path(sys.executable).with_name("fp8kv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fp8kv"]


def run_fp8kv(*args: str) -> str:
    done = subprocess.run([*fp8kv_command(), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fp8kv {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def file_scales(folder: Path) -> dict[int, dict[str, float]]:
    """The folder's per-layer k/v scales as fp8kv reads them (empty when it has none)."""
    report = json.loads(run_fp8kv("inspect", str(folder), "--json"))
    return {row["layer"]: {"k": row["k_scale"], "v": row["v_scale"]} for row in report["layers"]}


def json_scaling_factors(folder: Path) -> dict[int, float]:
    """The legacy JSON's one scale per layer (tensor-parallel rank 0), as SGLang reads it."""
    data = json.loads((folder / "kv_cache_scales.json").read_text())
    return {int(layer): float(value) for layer, value in data["kv_cache"]["scaling_factor"]["0"].items()}


def strip_scales(source: Path, out: Path) -> Path:
    """A copy of a compressed-tensors output without its k/v scale tensors (the config still declares them)."""
    shutil.copytree(source, out)
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    kept = {name: shard for name, shard in index["weight_map"].items() if not name.endswith(("k_scale", "v_scale"))}
    dropped = set(index["weight_map"].values()) - set(kept.values())
    index["weight_map"] = kept
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    for shard in dropped:
        (out / shard).unlink()
    return out


def probe(sglang_python: Path, folder: Path, flags: list[str], env: dict[str, str], timeout: int) -> dict[str, Any]:
    """One run of the loader probe: its JSON, or its one-line error, and its wall time."""
    start = time.perf_counter()
    try:
        done = subprocess.run([str(sglang_python), str(PROBE), str(folder), *flags], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {timeout} s", "wall_s": round(time.perf_counter() - start, 1)}
    wall = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}", "wall_s": wall}
    return {**json.loads(done.stdout), "wall_s": wall}


def _holds(held: list[float | None], candidates: dict[str, list[float | None]]) -> str:
    """The first candidate every layer's held value equals (exact float comparison), else 'other'."""
    for label, values in candidates.items():
        if all(h == v for h, v in zip(held, values, strict=True)):
            return label
    return "other"


def compare(result: dict[str, Any], file: dict[int, dict[str, float]], reference: dict[int, dict[str, float]],
            json_factors: dict[int, float] | None) -> dict[str, Any]:
    """Per layer the folder's k/v scales (as fp8kv reads them; null where it has none) and what SGLang holds; what
    K and V hold against the calibrated output's scales (`reference`); whether those loaded exactly."""
    layers = sorted(reference)
    if "error" in result:
        return {"loaded": "load failed", "error": result["error"]}
    held = {row["layer"]: row for row in result["layers"]}
    rows = [{"layer": layer, "file_k": file.get(layer, {}).get("k"), "file_v": file.get(layer, {}).get("v"),
             "held_k": held.get(layer, {}).get("k_scale"), "held_v": held.get(layer, {}).get("v_scale")}
            for layer in layers]
    ref_k = [reference[layer]["k"] for layer in layers]
    ref_v = [reference[layer]["v"] for layer in layers]
    common = {"max(file k, file v)": [max(k, v) for k, v in zip(ref_k, ref_v, strict=True)],
              "1.0": [1.0] * len(layers), "unset (None: runs at 1.0)": [None] * len(layers)}
    if json_factors is not None:
        common = {"the JSON's one scaling_factor per layer": [json_factors[layer] for layer in layers], **common}
    k_holds = _holds([row["held_k"] for row in rows], {"file k": ref_k, **common, "file v": ref_v})
    v_holds = _holds([row["held_v"] for row in rows], {"file v": ref_v, **common, "file k": ref_k})
    if k_holds == "file k" and v_holds == "file v":
        loaded = "exactly"
    elif k_holds in ("1.0", "unset (None: runs at 1.0)") and v_holds == k_holds:
        loaded = "1.0"
    else:
        loaded = "other"
    # The floats the kernels read (k_scale_float/v_scale_float), spelled out only where they differ from the above.
    floats = [(held.get(layer, {}).get("k_scale_float"), held.get(layer, {}).get("v_scale_float")) for layer in layers]
    if all(k is None and v is None for k, v in floats):
        held_float: Any = "unset"
    elif all((k, v) == (row["held_k"], row["held_v"]) for (k, v), row in zip(floats, rows, strict=True)):
        held_float = "same as held"
    else:
        held_float = {"k": [k for k, _ in floats], "v": [v for _, v in floats]}
    return {"loaded": loaded, "k_holds": k_holds, "v_holds": v_holds, "held_float": held_float, "layers": rows}


def cases(folders: dict[str, Path]) -> list[dict[str, Any]]:
    """Every (format, flags, environment) tried: the default path first, then what each format needs."""
    param = ["--quantization-param-path", str(folders["vllm-json"] / "kv_cache_scales.json")]
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    plain = [
        ("compressed-tensors", "compressed-tensors", fp8),
        ("compressed-tensors, --kv-cache-dtype auto", "compressed-tensors", ["--kv-cache-dtype", "auto"]),
        ("modelopt", "modelopt", fp8),
        ("vllm-json, no flag", "vllm-json", fp8),
        ("vllm-json, --quantization-param-path", "vllm-json", [*fp8, *param]),
        ("control: compressed-tensors without its scale tensors", "stripped", fp8),
        ("control: the uncalibrated source", "source", fp8),
    ]
    v2 = [
        ("compressed-tensors, weight loader v2", "compressed-tensors", fp8),
        ("modelopt, weight loader v2", "modelopt", fp8),
        ("vllm-json, --quantization-param-path, weight loader v2", "vllm-json", [*fp8, *param]),
    ]
    return ([{"name": n, "format": f, "flags": fl, "env": {}} for n, f, fl in plain]
            + [{"name": n, "format": f, "flags": fl, "env": V2_ENV} for n, f, fl in v2])


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per format with the legacy weight loader: the first case that loads scales, or the last tried."""
    out: dict[str, Any] = {}
    for row in rows:
        if row["env"]:
            continue
        entry = {"loaded": row["loaded"], "flags": row["flags"], "k_holds": row.get("k_holds"),
                 "v_holds": row.get("v_holds"), "held_float": row.get("held_float")}
        previous = out.get(row["format"])
        if previous is None or previous["loaded"] not in ("exactly", "other"):
            out[row["format"]] = entry
    for row in rows:
        if row["env"]:
            out[row["format"]]["weight_loader_v2"] = row["loaded"]
    return out


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dump(data: Any, indent: int = 0) -> str:
    """Indented JSON with each layer row and each list of plain values on one line, so the golden file stays
    small and diffs by layer."""
    pad = " " * indent
    if isinstance(data, dict) and "layer" not in data:
        if not data:
            return "{}"
        items = [f'{pad}  {json.dumps(key)}: {dump(value, indent + 2)}' for key, value in data.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(data, list) and any(isinstance(item, (dict, list)) for item in data):
        items = [f"{pad}  {dump(item, indent + 2)}" for item in data]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(data)


def _relative(path: Path) -> str:
    try:
        return path.absolute().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(text)
    os.chmod(handle.name, 0o644)  # a temporary file is private; the golden file is not
    os.replace(handle.name, path)


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--sglang-python", type=Path, default=DEFAULT_SGLANG_PYTHON)
    options.add_argument("--out", type=Path, help="default: tests/golden/sglang-VERSION.json")
    options.add_argument("--timeout", type=int, default=600, help="seconds for one probe run")
    args = options.parse_args()
    if not args.sglang_python.exists():
        print(f"no SGLang python at {args.sglang_python}: run probes/sglang_venv.sh", file=sys.stderr)
        return 2

    import torch

    from fp8kv.tools.factory import make_checkpoint

    cast = json.loads(subprocess.run([str(args.sglang_python), "-c", CAST_SCRIPT], capture_output=True, text=True,
                                     check=True).stdout)
    with tempfile.TemporaryDirectory(prefix="fp8kv-sglang-") as tmp:
        work = Path(tmp)
        spec = {k: v for k, v in MODEL.items() if k not in ("arch", "dtype")}
        source = make_checkpoint(MODEL["arch"], work / "source", dtype=getattr(torch, MODEL["dtype"]), **spec)
        folders = {"source": source, "compressed-tensors": work / "compressed-tensors"}
        run_fp8kv("calibrate", str(source), *CALIBRATE_ARGS, "--out", str(folders["compressed-tensors"]), "-q")
        for target in ("modelopt", "vllm-json"):
            folders[target] = work / target
            run_fp8kv("convert", str(folders["compressed-tensors"]), "--to", target, "--out", str(folders[target]))
        folders["stripped"] = strip_scales(folders["compressed-tensors"], work / "stripped")
        reference = file_scales(folders["compressed-tensors"])
        files = {name: file_scales(folder) for name, folder in folders.items()}
        factors = json_scaling_factors(folders["vllm-json"])

        rows, version, torch_version = [], None, None
        for case in cases(folders):
            result = probe(args.sglang_python, folders[case["format"]], case["flags"], case["env"], args.timeout)
            version = version or result.get("version")
            torch_version = torch_version or result.get("torch")
            row = {**case, **compare(result, files[case["format"]], reference,
                                     factors if case["format"] == "vllm-json" else None),
                   "warnings": result.get("warnings", []), "probe_wall_s": result["wall_s"]}
            # The temporary folder's name means nothing in a golden file.
            where = str(folders[case["format"]])
            row["flags"] = [flag.replace(where, "DIR") for flag in row["flags"]]
            row["warnings"] = [line.replace(where, "DIR") for line in row["warnings"]]
            rows.append(row)
            print(f"{row['name']:<58} {row['loaded']:<12} k: {row.get('k_holds')}, v: {row.get('v_holds')}"
                  f"{'  ' + row['error'] if 'error' in row else ''}", file=sys.stderr, flush=True)
    if version is None:
        print("no probe run succeeded", file=sys.stderr)
        return 1

    tag = "cp" + "".join(cast["python"].split(".")[:2])
    wheels = sorted((args.sglang_python.parent.parent / "wheels").glob(f"sglang-{version}-*.whl"),
                    key=lambda wheel: f"-{tag}-" not in wheel.name)  # this python's wheel first
    e4m3 = cast["float8_e4m3fn"]["bytes"]
    golden = {
        "engine": "sglang",
        "version": version,
        "provenance": {
            "sglang": version,
            "wheel": wheels[0].name if wheels else None,
            "wheel_sha256": sha256(wheels[0]) if wheels else None,
            "torch": torch_version,
            "python": cast["python"],
            "fp8kv_python": platform.python_version(),
            "machine": platform.machine(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join([_relative(Path(sys.executable)), _relative(Path(sys.argv[0])), *sys.argv[1:]]),
            "probe": "loadcheck/probes/sglang.py: ServerArgs(device=cpu), publish, gloo world of 1, "
                     "ModelConfig.from_server_args, model_loader.get_model, load_kv_cache_scales",
        },
        "model": {**MODEL, "factory": "tools/factory.py make_checkpoint",
                  "calibrate": ["fp8kv", "calibrate", "SOURCE", *CALIBRATE_ARGS]},
        "cast": {**cast, "e4m3_saturates": e4m3[:3] == ["0x7e"] * 3 and e4m3[3] == "0xfe"},
        "file_scales": {"from": "fp8kv inspect --json of the calibrated compressed-tensors output",
                        "layers": sorted(reference), "k": [reference[layer]["k"] for layer in sorted(reference)],
                        "v": [reference[layer]["v"] for layer in sorted(reference)],
                        "vllm_json_scaling_factor": [factors[layer] for layer in sorted(factors)]},
        "summary": summary(rows),
        "cases": rows,
        "read_in_source_not_run": SOURCE_NOTES,
    }
    out = args.out or ROOT / "tests" / "golden" / f"sglang-{version}.json"
    write_atomically(out, dump(golden) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
