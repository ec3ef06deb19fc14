"""Load checkpoints in vLLM and print the k/v (and q) scale each attention layer holds against the file's.

Runs in vLLM's own venv (probes/vllm_venv.sh builds bench/.vllm-venv), not fp8kv's:

    bench/.vllm-venv/bin/python probes/vllm_load_check.py MANIFEST.json --out RESULTS.json

MANIFEST is a JSON list of cases, as probes/vllm_loading.py writes it:
`{"name", "path", "file": {layer: {"k": s, "v": s, "q": s or null}}, "engine_args": {...}}`.
Each case loads in a child process (vLLM keeps process-wide state, and a refused load must not end
the run). The held scales are read when vLLM's loader has finished processing the weights
(`process_weights_after_loading`): a CPU without AVX-512 refuses an fp8 cache after that point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# A held scale equals the file's when it is the same float32 (vLLM keeps float32 scales as Python floats);
# within bf16's unit roundoff (2^-8 relative: 8 significant bits) it is the file's scale rounded to the model
# dtype, as vLLM does with a scale it loads into a parameter of the model's dtype.
_TOLERANCE = 1e-7
_BF16_ROUNDOFF = 2.0**-8
_SCALE_LOG = re.compile(r"scal|kv.cache|k_scale|MLA", re.IGNORECASE)


def held_scales(model: Any) -> dict[str, dict[str, float]]:
    """Every attention layer's scales as vLLM will use them, keyed by its layer name."""
    held = {}
    for module in model.modules():
        if hasattr(module, "_k_scale_float") and hasattr(module, "layer_name"):
            held[module.layer_name] = {"k": float(module._k_scale_float), "v": float(module._v_scale_float),
                                       "q": float(getattr(module, "_q_scale_float", 1.0))}
    return held


def load_one(path: str, engine_args: dict[str, Any], result_file: str) -> None:
    """In this process: load `path` in vLLM with an fp8 cache, write what its layers hold to `result_file`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: the spy sees it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.model_executor.model_loader import base_loader

    result: dict[str, Any] = {"held": None, "error": None, "served": None}
    original = base_loader.process_weights_after_loading

    def spy(model, model_config, target_device):
        original(model, model_config, target_device)
        result["held"] = held_scales(model)

    base_loader.process_weights_after_loading = spy
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, kv_cache_dtype="fp8", enforce_eager=True, max_model_len=128, max_num_seqs=1,
                  dtype="bfloat16", **engine_args)
        out = llm.generate(["The"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        result["served"] = len(out[0].outputs[0].token_ids)
    except Exception as exc:  # the point is to record what vLLM says, whatever it raises
        result["error"] = f"{type(exc).__name__}: {_last_line(str(exc))}"
    Path(result_file).write_text(json.dumps(result))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_case(case: dict[str, Any], timeout: int) -> dict[str, Any]:
    """Load one case in a child process and compare what vLLM holds with the file's scales."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        command = [sys.executable, __file__, "--one", case["path"], "--engine-args",
                   json.dumps(case.get("engine_args") or {}), "--result", result_file]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**case, "status": "timeout", "error": f"no answer in {timeout} s", "layers": [], "log": []}
        if not Path(result_file).exists():
            return {**case, "status": "crashed", "error": _last_line(child.stderr), "layers": [], "log": []}
        result = json.loads(Path(result_file).read_text())
    return {**case, **compare(case["file"], result), "log": scale_warnings(child.stdout + child.stderr)}


def scale_warnings(stderr: str) -> list[str]:
    """vLLM's warnings about scales and the KV cache (they say when it ignores a scale), each once."""
    lines = [line.split("] ", 1)[-1] for line in stderr.splitlines() if " WARNING " in line and _SCALE_LOG.search(line)]
    return list(dict.fromkeys(lines))


def compare(file_scales: dict[str, dict[str, float | None]], result: dict[str, Any]) -> dict[str, Any]:
    """Per layer: the file's k/v/q scale, what vLLM holds, and whether they agree; an overall status."""
    held = {_layer_index(name): values for name, values in (result["held"] or {}).items()}
    layers = []
    for layer in sorted(file_scales, key=int):
        want, got = file_scales[layer], held.get(int(layer))
        row = {"layer": int(layer), **{f"file_{p}": want.get(p) for p in "kvq"},
               **{f"vllm_{p}": (got or {}).get(p) for p in "kvq"}}
        compared = [p for p in "kvq" if want.get(p) is not None]
        row["rel_err"] = None if got is None else max(abs(got[p] - want[p]) / want[p] for p in compared)
        row["exact"] = row["rel_err"] is not None and row["rel_err"] <= _TOLERANCE
        layers.append(row)
    return {"status": verdict(layers, result["held"] is not None), "error": result["error"],
            "served_tokens": result["served"], "layers": layers}


def verdict(layers: list[dict[str, Any]], loaded: bool) -> str:
    """exact, bf16-rounded, ignored (1.0), mismatch or load failed, from the compared layers."""
    if not loaded:
        return "load failed"
    if layers and all(row["exact"] for row in layers):
        return "exact"
    if layers and all(row["rel_err"] is not None and row["rel_err"] <= _BF16_ROUNDOFF for row in layers):
        return "bf16-rounded"
    if layers and all(row["vllm_k"] == 1.0 and row["vllm_v"] == 1.0 for row in layers):
        return "ignored (1.0)"
    return "mismatch"


def _layer_index(layer_name: str) -> int:
    return int(re.search(r"\.(\d+)\.", f".{layer_name}.").group(1))


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("manifest", nargs="?")
    options.add_argument("--out", help="where to write the results JSON")
    options.add_argument("--timeout", type=int, default=600)
    options.add_argument("--one", help=argparse.SUPPRESS)
    options.add_argument("--engine-args", default="{}", help=argparse.SUPPRESS)
    options.add_argument("--result", help=argparse.SUPPRESS)
    args = options.parse_args()
    if args.one:
        load_one(args.one, json.loads(args.engine_args), args.result)
        return 0
    import vllm

    cases = json.loads(Path(args.manifest).read_text())
    rows = []
    for case in cases:
        row = run_case(case, args.timeout)
        rows.append(row)
        print(f"{row['name']:<40} {row['status']:<14} {summary(row)}", flush=True)
    meta = {"vllm": vllm.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "load": os.getloadavg()}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def summary(row: dict[str, Any]) -> str:
    """One line: the first layer's file and held scales, or vLLM's error."""
    if row["status"] == "load failed" or not row["layers"]:
        return row.get("error") or ""
    first = row["layers"][0]
    text = (f"layer {first['layer']}: k {first['file_k']:.6g}->{first['vllm_k']:.6g}, "
            f"v {first['file_v']:.6g}->{first['vllm_v']:.6g}")
    if first["file_q"] is not None:
        text += f", q {first['file_q']:.6g}->{first['vllm_q']:.6g}"
    return text


if __name__ == "__main__":
    sys.exit(main())
