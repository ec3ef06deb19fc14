"""What SGLang's own NVFP4 KV-cache method holds as each layer's global scale, run on a CPU with its one GPU question
answered for each GPU generation: the factor and the kept 1.0 of configs/engines.toml's [[nvfp4]] rows for SGLang,
recorded for tests/test_engine_releases.py.

A standalone script for SGLang's python (the venv probes/sglang_venv.sh builds; stdlib, torch, safetensors, sglang):

    bench/.sglang-venv/bin/python probes/sglang_nvfp4_loader.py CHECKPOINT_DIR [--unit-layer N] [--out FILE]

CHECKPOINT_DIR is an NVFP4 folder with ModelOpt's names (`fp8kv calibrate MODEL --kv-dtype nvfp4`); --unit-layer N
adds a copy whose layer N stores k_scale 1.0, the value SGLang takes for "no calibrated scale". Each folder loads
the way loadcheck/probes/sglang.py loads it (a scheduler's start-up path, no forward pass), then, as SGLang's
KV-cache configurator does at start-up (mem_cache/kv_cache_configurator.py), `get_kv_cache_quant_method` builds the
method `--kv-cache-dtype nvfp4` names and `load_scales_from_model(model)` runs, under SGLang's own
`override_platform(is_sm100=...)` for each GPU generation (the method asks `get_platform().is_sm100`, which is
`is_sm100_supported()`: compute capability 10.x; sm120 answers False).

SGLang's server arguments refuse nvfp4 on a machine without CUDA (the probe records its line), so the model loads
with `--kv-cache-dtype auto`: the checkpoint's ModelOpt quantization config loads k_scale and v_scale into each
RadixAttention whatever the cache dtype (only a --quantization-param-path file depends on it, and only for
fp8_e4m3); `loaded` records what they held. Per folder and layer: the file's K/V scales, the loaded ones, and per
GPU generation what the method holds: k_scales_gpu/v_scales_gpu (float32; the cache write and FlashInfer's
dequantization read them) and k_scales_float/v_scales_float (Python floats; TRT-LLM attention's bmm scales).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
sys.path.insert(0, str(_HERE))
from outputs import emit_json  # noqa: E402  (probes/outputs.py, beside this script)

# is_sm100_supported() is compute capability 10.x: what each GPU generation of the rows answers
GPUS = {"sm100": True, "sm120": False}
# the cache dtype the model loads with, where SGLang refuses nvfp4 (see the docstring)
LOADED_WITH = "auto"
SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_proj\.[kv]_scale$")


def _loader() -> Any:  # loadcheck/probes/sglang.py, loaded by path
    spec = importlib.util.spec_from_file_location("sglang_loadcheck", _ROOT / "loadcheck" / "probes" / "sglang.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # it drops its own folder from sys.path, so `import sglang` is the package
    return module


def _scale_tensors(folder: Path) -> dict[tuple[int, str], tuple[Path, str]]:
    """Each layer's ModelOpt K/V scale tensor: (layer, "k" or "v") -> (its file, its name)."""
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                if match := SCALE_NAME.search(name):
                    found[int(match[1]), match[2]] = (path, name)
    return found


def _stored(folder: Path) -> dict[str, list[float]]:
    from safetensors import safe_open

    tensors = _scale_tensors(folder)
    layers = sorted({layer for layer, _ in tensors})
    values: dict[str, list[float]] = {"k": [], "v": []}
    for layer in layers:
        for side in values:
            path, name = tensors[layer, side]
            with safe_open(str(path), "pt") as handle:
                values[side].append(float(handle.get_tensor(name).item()))
    return values


def _unit_copy(folder: Path, layer: int, into: Path) -> Path:
    """A copy of `folder` whose layer `layer` stores k_scale 1.0 (its own dtype and shape, the file's metadata)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    copy = into / f"{folder.name}-unit-k{layer}"
    shutil.copytree(folder, copy)
    path, name = _scale_tensors(copy)[layer, "k"]
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors[name] = torch.ones_like(tensors[name])
    save_file(tensors, str(path), metadata=metadata)
    return copy


def _refusal(folder: Path) -> str:
    """SGLang's own line for why its server arguments refuse nvfp4 here."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    try:
        publish(ServerArgs(model_path=str(folder), device="cpu", kv_cache_dtype="nvfp4", skip_tokenizer_init=True),
                role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    except (ValueError, RuntimeError) as error:
        return str(error)
    raise SystemExit("SGLang accepted --kv-cache-dtype nvfp4 on this machine: load with it, not auto")


def _held(model: Any, recipe: str, num_layers: int) -> dict[str, dict[str, list[float]]]:
    """Per GPU generation, the K/V global scales NVFP4KVCacheMethod holds after load_scales_from_model."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import get_kv_cache_quant_method
    from sglang.srt.runtime_context import override_platform

    held = {}
    for gpu, is_sm100 in GPUS.items():
        with override_platform(is_sm100=is_sm100):
            method = get_kv_cache_quant_method(recipe, num_layers=num_layers, device="cpu")
            method.load_scales_from_model(model)
        held[gpu] = {"k": method.k_scales_gpu.tolist(), "v": method.v_scales_gpu.tolist(),
                     "k_float": list(method.k_scales_float), "v_float": list(method.v_scales_float)}
    return held


def _checkpoint(loader: Any, folder: Path, recipe: str) -> dict[str, Any]:
    stored = _stored(folder)
    model = loader.load_model(str(folder), kv_cache_dtype=LOADED_WITH)
    rows = loader.held_scales(model)
    loaded = {"k": [row["k_scale"] for row in rows], "v": [row["v_scale"] for row in rows]}
    return {"file": stored, "loaded": loaded, "held": _held(model, recipe, len(stored["k"]))}


def _kv_cache_dtype_choices() -> list[str]:
    """What SGLang's own command line takes for --kv-cache-dtype."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(action for action in parser._actions if "--kv-cache-dtype" in action.option_strings)
    return list(action.choices or ())


def _relative(path: str) -> str:
    absolute = Path(path).absolute()
    return str(absolute.relative_to(_ROOT)) if absolute.is_relative_to(_ROOT) else path


def _meta(folder: Path, module: Any) -> dict[str, Any]:
    import sglang
    import torch

    record = folder / "fp8kv.json"
    calibrated = json.loads(record.read_text())["command"] if record.is_file() else None
    return {"sglang": sglang.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "module_sha256": hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join([_relative(sys.executable), _relative(sys.argv[0]), *sys.argv[1:]]),
            "checkpoint": calibrated}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("checkpoint", type=Path)
    options.add_argument("--unit-layer", type=int, help="also load a copy whose layer N stores k_scale 1.0")
    options.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    args = options.parse_args()
    loader = _loader()
    from sglang.srt.layers.quantization import fp4_kv_cache_quant_method as module

    recipe = module.resolve_kv_cache_quant("nvfp4")
    refusal = _refusal(args.checkpoint)
    out = {"probe": "probes/sglang_nvfp4_loader.py", "how": "run", "engine": "sglang",
           "module": "sglang/srt/layers/quantization/fp4_kv_cache_quant_method.py",
           "method": f"{module.KV_CACHE_QUANT_REGISTRY[recipe].__name__}.load_scales_from_model",
           "kv_cache_dtype": "nvfp4", "recipe": recipe, "kv_cache_dtype_choices": _kv_cache_dtype_choices(),
           "refused_on_cpu": refusal, "loaded_with": LOADED_WITH,
           "meta": _meta(args.checkpoint, module), "checkpoints": {}}
    out["checkpoints"]["calibrated"] = _checkpoint(loader, args.checkpoint, recipe)
    if args.unit_layer is not None:
        with tempfile.TemporaryDirectory(prefix="sglang-nvfp4-") as scratch:
            copy = _unit_copy(args.checkpoint, args.unit_layer, Path(scratch))
            out["checkpoints"][f"layer {args.unit_layer} stores k_scale 1.0"] = _checkpoint(loader, copy, recipe)
    emit_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
