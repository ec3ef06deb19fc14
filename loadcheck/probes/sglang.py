"""Load a checkpoint through SGLang's own start-up path on CPU and print the KV scales each attention layer holds.

A standalone script for SGLang's python (stdlib, torch and sglang only; fp8kv is not installed there):

    PYTHON loadcheck/probes/sglang.py CHECKPOINT_DIR [--quantization-param-path FILE] [--kv-cache-dtype fp8_e4m3]
    PYTHON loadcheck/probes/sglang.py --each LOADS.jsonl      # several loads in one process (probe_io.py)
    PYTHON loadcheck/probes/sglang.py --architectures         # the model classes SGLang has

It goes the way a scheduler process does: `ServerArgs`, the runtime context published from it, a world of one
rank on gloo (once per process), `ModelConfig.from_server_args`, the loader's `LoadConfig`,
`model_loader.get_model`, then `load_kv_cache_scales` (which reads a `--quantization-param-path` file). No forward
pass runs, so the CUDA kernels are never needed. Stdout carries one JSON object:

    {"engine": "sglang", "version", "torch", "layers": [{"layer", "k_scale", "v_scale", "k_scale_float",
     "v_scale_float"}], "warnings": [...]}

`k_scale`/`v_scale` are what each `RadixAttention` holds (a float32 tensor read as a Python float, exact, or
the float a param file assigned), `*_float` the Python floats its kernels read (null when unset). On failure
it exits 1 with SGLang's own error line last on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import socket
import sys
import types
from typing import Any

# This file is named sglang.py and Python puts its folder first on sys.path: drop it, or `import sglang`
# finds this script instead of the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
_IO_SPEC = importlib.util.spec_from_file_location("probe_io", os.path.join(_HERE, "probe_io.py"))
assert _IO_SPEC is not None and _IO_SPEC.loader is not None
probe_io = importlib.util.module_from_spec(_IO_SPEC)
_IO_SPEC.loader.exec_module(probe_io)
_started: list[bool] = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stub_cuda_only_imports() -> None:
    """Give SGLang's rotary layer the one CUDA-only import that blocks loading on a machine without a GPU.

    On a machine it sees as neither CUDA nor its own CPU engine (opted into with SGLANG_USE_CPU_ENGINE=1, a
    path with kernels of its own), the rotary layer's constructor imports `rotary_embedding` from
    `vllm._custom_ops`; vLLM is not installed beside SGLang, and only a forward pass would call the kernel.
    """
    try:
        import vllm._custom_ops  # noqa: F401
        return
    except Exception:
        pass

    def _missing(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("rotary_embedding is a CUDA kernel; this probe only loads weights")

    vllm = sys.modules.get("vllm") or types.ModuleType("vllm")
    vllm.__path__ = []  # a package, so `vllm._custom_ops` resolves
    custom_ops = types.ModuleType("vllm._custom_ops")
    custom_ops.rotary_embedding = _missing  # type: ignore[attr-defined]
    vllm._custom_ops = custom_ops  # type: ignore[attr-defined]
    sys.modules["vllm"] = vllm
    sys.modules["vllm._custom_ops"] = custom_ops


def _as_float(value: Any) -> float | None:
    """A scale as a Python float: a float32 tensor's value exactly; None when unset."""
    if value is None:
        return None
    if hasattr(value, "numel"):
        if value.numel() != 1:
            raise ValueError(f"a scale of shape {tuple(value.shape)}, not one value per layer")
        return float(value.detach().to("cpu").reshape(()).item())
    return float(value)


def held_scales(model: Any) -> list[dict[str, Any]]:
    """Every `RadixAttention`'s scales, by layer index."""
    from sglang.srt.layers.radix_attention import RadixAttention

    rows = []
    for module in model.modules():
        if isinstance(module, RadixAttention):
            rows.append({"layer": int(module.layer_id), "k_scale": _as_float(module.k_scale),
                         "v_scale": _as_float(module.v_scale), "k_scale_float": _as_float(module.k_scale_float),
                         "v_scale_float": _as_float(module.v_scale_float)})
    return sorted(rows, key=lambda row: row["layer"])


def _start_world() -> None:
    """A world of one rank, once per process (SGLang refuses to initialise its groups twice)."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    if _started:
        return
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    initialize_model_parallel()
    _started.append(True)


def load(checkpoint: str, quantization_param_path: str | None = None,
         kv_cache_dtype: str = "fp8_e4m3") -> dict[str, Any]:
    """What SGLang's loader builds from `checkpoint`, its scales as a scheduler would have them: the probe's JSON
    object (less its warnings)."""
    import sglang
    import torch

    model = load_model(checkpoint, quantization_param_path, kv_cache_dtype)
    return {"engine": "sglang", "version": sglang.__version__, "torch": torch.__version__,
            "layers": held_scales(model)}


def load_model(checkpoint: str, quantization_param_path: str | None = None,
               kv_cache_dtype: str = "fp8_e4m3") -> Any:
    """The model SGLang's loader builds from `checkpoint`, its scales loaded as a scheduler's start-up loads them."""
    # SGLang takes a path that is not a folder for a Hub id, and this machine reaches no Hub.
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise FileNotFoundError(f"no checkpoint at {checkpoint} (no config.json)")
    if quantization_param_path and not os.path.isfile(quantization_param_path):
        raise FileNotFoundError(f"no --quantization-param-path file {quantization_param_path}")
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.load_model_utils import load_kv_cache_scales
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.runtime_context import get_model as model_settings
    from sglang.srt.server_args import ServerArgs

    _stub_cuda_only_imports()
    server_args = ServerArgs(model_path=os.path.abspath(checkpoint), device="cpu", kv_cache_dtype=kv_cache_dtype,
                             quantization_param_path=quantization_param_path, skip_tokenizer_init=True,
                             tp_size=1)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    _start_world()
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=server_args.load_format, download_dir=server_args.download_dir)
    with torch.device("cpu"):
        model = get_model(model_config=model_config, load_config=load_config, device_config=DeviceConfig("cpu"))
    load_kv_cache_scales(model=model, kv_cache_dtype=model_settings().kv_cache_dtype)
    return model


def architectures() -> dict[str, Any]:
    """The model classes SGLang's registry serves with a model of its own."""
    import sglang
    from sglang.srt.models.registry import ModelRegistry

    return {"engine": "sglang", "version": sglang.__version__,
            "architectures": sorted(ModelRegistry.get_supported_archs())}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("checkpoint", nargs="?")
    options.add_argument("--quantization-param-path", default=None)
    options.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    options.add_argument("--each", help="a file of loads, one JSON object per line")
    options.add_argument("--architectures", action="store_true", help="print the model classes SGLang has")
    args = options.parse_args()
    if args.architectures:
        print(json.dumps(architectures()))
        return 0
    if (args.checkpoint is None) == (args.each is None):
        options.error("give a CHECKPOINT_DIR or --each FILE")
    log = probe_io.EngineLog("sglang")
    logging.getLogger().setLevel(logging.INFO)  # SGLang's INFO lines say which scales it loaded
    single = {"checkpoint": args.checkpoint, "quantization_param_path": args.quantization_param_path,
              "kv_cache_dtype": args.kv_cache_dtype}
    return probe_io.answer(load, log, single, args.each)


if __name__ == "__main__":
    probe_io.exit_now(main())
