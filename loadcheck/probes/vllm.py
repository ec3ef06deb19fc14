"""Load a checkpoint with vLLM's own loader and print the K/V scales each attention layer holds, as one JSON object.

Runs in vLLM's Python, not fp8kv's (vLLM pins its own torch), and imports nothing from fp8kv:

    ENGINE_PYTHON loadcheck/probes/vllm.py CHECKPOINT_DIR [--kv-cache-dtype fp8]

stdout: {"engine": "vllm", "version", "torch", "layers": [{"layer", "name", "k_scale", "v_scale", "q_scale"}],
"warnings": [vLLM's warnings about scales and the KV cache]}; vLLM's own log goes to stderr. A failure exits 1
with one line on stderr (the last). vLLM keeps process-wide state: one load per process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

# This file is named vllm.py, and Python puts its folder first on sys.path: `import vllm` would import it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_SCALE_LOG = re.compile(r"scal|kv.cache|k_scale|MLA", re.IGNORECASE)


class _Loaded(Exception):
    """Raised once the weights are processed: what the layers hold is known, the rest of start-up is not needed
    (and a CPU without AVX-512 refuses an fp8 cache after this point)."""


def held_scales(model: Any) -> list[dict[str, Any]]:
    """Every attention layer's scales as vLLM's attention backend reads them (`_k_scale_float`, ...), by layer."""
    layers = []
    for module in model.modules():
        if not (hasattr(module, "_k_scale_float") and hasattr(module, "layer_name")):
            continue
        found = _LAYER_INDEX.search(f".{module.layer_name}.")
        if found is None:
            raise RuntimeError(f"attention layer {module.layer_name!r} has no layer number in its name")
        row = {"layer": int(found.group(1)), "name": module.layer_name, "k_scale": float(module._k_scale_float),
               "v_scale": float(module._v_scale_float), "q_scale": float(getattr(module, "_q_scale_float", 1.0))}
        for part in ("k", "v"):  # per-head buffers: a CUDA backend reads them, the CPU one reads the float above
            buffer = getattr(module, f"_{part}_scale", None)
            if buffer is not None and buffer.numel() > 1:
                row[f"{part}_scale_heads"] = [float(x) for x in buffer.flatten().tolist()]
        layers.append(row)
    return sorted(layers, key=lambda row: row["layer"])


def _capture_warnings(into: list[str]) -> None:
    """Keep vLLM's warnings about scales and the KV cache, each once. A record factory sees every record however
    vLLM reconfigures its handlers later."""
    make_record = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if record.name.startswith("vllm") and record.levelno >= logging.WARNING:
            message = record.getMessage()
            if _SCALE_LOG.search(message) and message not in into:
                into.append(message)
        return record

    logging.setLogRecordFactory(factory)


def load(checkpoint: str, kv_cache_dtype: str, dtype: str) -> dict[str, Any]:
    """Load `checkpoint` in this process and return the probe's JSON object."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: the spy sees it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    warnings: list[str] = []
    _capture_warnings(warnings)
    import vllm  # first: a python without vllm is told so before torch takes seconds to import
    import torch
    from vllm.model_executor.model_loader import base_loader

    held: list[list[dict[str, Any]]] = []
    original = base_loader.process_weights_after_loading

    def spy(model: Any, model_config: Any, target_device: Any) -> None:
        original(model, model_config, target_device)
        held.append(held_scales(model))
        raise _Loaded

    base_loader.process_weights_after_loading = spy
    try:
        vllm.LLM(model=checkpoint, kv_cache_dtype=kv_cache_dtype, dtype=dtype, enforce_eager=True, max_model_len=128,
                 max_num_seqs=1, skip_tokenizer_init=True)
    except Exception as exc:  # _Loaded, however vLLM wraps it; anything else before it is vLLM refusing the load
        if not held:
            raise RuntimeError(f"vLLM did not load {checkpoint}: {_last_line(str(exc)) or type(exc).__name__}") from exc
    if not held:
        raise RuntimeError(f"vLLM started without processing the weights of {checkpoint}")
    return {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__, "layers": held[0],
            "warnings": warnings}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("checkpoint")
    options.add_argument("--kv-cache-dtype", default="fp8")
    options.add_argument("--dtype", default="auto")  # the model's own, as `vllm serve` takes it
    args = options.parse_args()
    # Only the JSON object goes to stdout: everything else printed to fd 1 (vLLM's, torch's, C code's) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        result = load(args.checkpoint, args.kv_cache_dtype, args.dtype)
    except ModuleNotFoundError as exc:
        print(f"no module named {exc.name}", file=sys.stderr)
        return 1
    except Exception as exc:  # one line for fp8kv to show; vLLM's log above it has the detail
        print(_last_line(str(exc)) or type(exc).__name__, file=sys.stderr)
        return 1
    out.write(json.dumps(result) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # a half-started engine: its exit handlers have nothing to shut down, and can hang
