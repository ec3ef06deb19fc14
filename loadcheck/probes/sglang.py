"""Load a checkpoint through SGLang's own start-up path on CPU and print the KV scales each attention layer holds.

A standalone script for SGLang's python (stdlib, torch and sglang only; fp8kv is not installed there):

    PYTHON loadcheck/probes/sglang.py CHECKPOINT_DIR [--quantization-param-path FILE] [--kv-cache-dtype fp8_e4m3]

It goes the way a scheduler process does: `ServerArgs`, the runtime context published from it, a world of one
rank on gloo, `ModelConfig.from_server_args`, the loader's `LoadConfig`, `model_loader.get_model`, then
`load_kv_cache_scales` (which reads a `--quantization-param-path` file). No forward pass runs, so the CUDA
kernels are never needed. Stdout carries one JSON object:

    {"engine": "sglang", "version", "torch", "layers": [{"layer", "k_scale", "v_scale", "k_scale_float",
     "v_scale_float"}], "warnings": [...]}

`k_scale`/`v_scale` are what each `RadixAttention` holds (a float32 tensor read as a Python float, exact, or
the float a param file assigned), `*_float` the Python floats its kernels read (null when unset). On failure
it exits 1 with one stderr line naming what is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import types
from typing import Any

# This file is named sglang.py and Python puts its folder first on sys.path: drop it, or `import sglang`
# finds this script instead of the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
# Log lines worth keeping: what SGLang says about KV scales and the fp8 cache.
_SCALE_LOG = re.compile(r"scal|kv.cache|kv_cache|fp8", re.IGNORECASE)


class _Collector(logging.Handler):
    """Keeps SGLang's log lines about scales, each once, in the order they came."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record must not end the probe
            return
        if record.levelno >= logging.INFO and _SCALE_LOG.search(message):
            line = f"{record.levelname}: {message.strip()}"
            if line not in self.lines:
                self.lines.append(line)


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


def load(checkpoint: str, quantization_param_path: str | None, kv_cache_dtype: str) -> Any:
    """The model SGLang's loader builds from `checkpoint`, its scales as a scheduler would have them."""
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_executor.model_runner_components.load_model_utils import load_kv_cache_scales
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.runtime_context import get_model as model_settings
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=checkpoint, device="cpu", kv_cache_dtype=kv_cache_dtype,
                             quantization_param_path=quantization_param_path, skip_tokenizer_init=True,
                             tp_size=1)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    initialize_model_parallel()
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=server_args.load_format, download_dir=server_args.download_dir)
    with torch.device("cpu"):
        model = get_model(model_config=model_config, load_config=load_config, device_config=DeviceConfig("cpu"))
    load_kv_cache_scales(model=model, kv_cache_dtype=model_settings().kv_cache_dtype)
    return model


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("checkpoint")
    options.add_argument("--quantization-param-path", default=None)
    options.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    args = options.parse_args()
    # SGLang takes a path that is not a folder for a Hub id, and this machine reaches no Hub.
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        print(f"sglang probe: no checkpoint at {args.checkpoint} (no config.json)", file=sys.stderr)
        return 1
    if args.quantization_param_path and not os.path.isfile(args.quantization_param_path):
        print(f"sglang probe: no --quantization-param-path file {args.quantization_param_path}", file=sys.stderr)
        return 1

    # Stdout is for the one JSON object: everything SGLang prints or logs goes to stderr, at the fd level too.
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    collector = _Collector()
    logging.getLogger().addHandler(collector)
    logging.getLogger().setLevel(logging.INFO)

    try:
        import sglang
        import torch

        _stub_cuda_only_imports()
        model = load(os.path.abspath(args.checkpoint), args.quantization_param_path, args.kv_cache_dtype)
        layers = held_scales(model)
    except ModuleNotFoundError as exc:
        print(f"sglang probe: missing module {exc.name!r} ({exc})", file=sys.stderr)
        return 1
    except Exception as exc:  # report what SGLang raised, in one line
        text = " ".join(str(exc).split())[:400]
        print(f"sglang probe: load failed: {type(exc).__name__}: {text}", file=sys.stderr)
        return 1
    if not layers:
        print("sglang probe: the loaded model has no RadixAttention layer", file=sys.stderr)
        return 1
    result = {"engine": "sglang", "version": sglang.__version__, "torch": torch.__version__, "layers": layers,
              "warnings": collector.lines}
    with result_out:
        result_out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # SGLang leaves threads and a gloo group behind; exit without waiting on them.
    os._exit(code)
