"""Load a checkpoint with vLLM's own loader and print the K/V scales each attention layer holds, as one JSON object.

Runs in vLLM's Python, not fp8kv's (vLLM pins its own torch), and imports nothing from fp8kv:

    ENGINE_PYTHON loadcheck/probes/vllm.py CHECKPOINT_DIR [--kv-cache-dtype fp8] [--dtype auto]
    ENGINE_PYTHON loadcheck/probes/vllm.py --each LOADS.jsonl      # several loads in one process (probe_io.py)
    ENGINE_PYTHON loadcheck/probes/vllm.py --architectures         # the model classes vLLM has

It goes the way vLLM's CPU worker does: `EngineArgs(...).create_engine_config()` (where vLLM inspects the
architecture and refuses what it cannot serve), a world of one rank on gloo, then `model_loader.get_model`, which
loads the weights and runs each quant method's `process_weights_after_loading`; the KV cache and the engine core
are never started. stdout: {"engine": "vllm", "version", "torch", "layers": [{"layer", "name", "k_scale",
"v_scale", "q_scale"}], "warnings": [vLLM's log lines about scales and the KV cache]}; vLLM's own log goes to
stderr. A failure exits 1 with vLLM's own error line last on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

# This file is named vllm.py, and Python puts its folder first on sys.path: `import vllm` would import it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
_IO_SPEC = importlib.util.spec_from_file_location("probe_io", _HERE / "probe_io.py")
assert _IO_SPEC is not None and _IO_SPEC.loader is not None
probe_io = importlib.util.module_from_spec(_IO_SPEC)
_IO_SPEC.loader.exec_module(probe_io)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_started: list[bool] = []


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


def _called_here(function: Any) -> Any:
    return function()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_world() -> None:
    """A world of one rank once per process (vLLM refuses to initialise it twice), and its model-parallel groups
    for the current config (an MoE model needs an expert-parallel group a dense one does not get)."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import destroy_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    if not _started:
        # what vLLM's CPU model runner does first: torch.accelerator calls in the shared loader become no-ops
        _set_torch_accelerator_to_noop()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        _started.append(True)
    destroy_model_parallel()
    ensure_model_parallel_initialized(1, 1)


def load(checkpoint: str, kv_cache_dtype: str = "fp8", dtype: str = "auto") -> dict[str, Any]:
    """Load `checkpoint` in this process and return the probe's JSON object (less its warnings)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import vllm  # first: a python without vllm is told so before torch takes seconds to import
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models import registry

    # vLLM inspects each model class in a subprocess so the inspection cannot initialise CUDA in its own process;
    # on a CPU there is none, and a fresh vLLM import per class (seconds each) would be most of a loader matrix
    registry._run_in_subprocess = _called_here

    config = EngineArgs(model=checkpoint, kv_cache_dtype=kv_cache_dtype, dtype=dtype, enforce_eager=True,
                        max_model_len=128, max_num_seqs=1, skip_tokenizer_init=True).create_engine_config()
    with set_current_vllm_config(config):
        _start_world()
        model = get_model(vllm_config=config)
    return {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__, "layers": held_scales(model)}


def architectures() -> dict[str, Any]:
    """The model classes vLLM's registry serves with a model of its own."""
    import vllm
    from vllm.model_executor.models.registry import ModelRegistry

    return {"engine": "vllm", "version": vllm.__version__, "architectures": sorted(ModelRegistry.get_supported_archs())}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("checkpoint", nargs="?")
    options.add_argument("--kv-cache-dtype", default="fp8")
    options.add_argument("--dtype", default="auto")  # the model's own, as `vllm serve` takes it
    options.add_argument("--each", help="a file of loads, one JSON object per line")
    options.add_argument("--architectures", action="store_true", help="print the model classes vLLM has")
    args = options.parse_args()
    if args.architectures:
        print(json.dumps(architectures()))
        return 0
    if (args.checkpoint is None) == (args.each is None):
        options.error("give a CHECKPOINT_DIR or --each FILE")
    log = probe_io.EngineLog("vllm")
    single = {"checkpoint": args.checkpoint, "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    return probe_io.answer(load, log, single, args.each)


if __name__ == "__main__":
    probe_io.exit_now(main())
