"""What SGLang's own NVFP4 KV-cache method makes of a checkpoint's global scales, on a CPU, with its GPU check
answered each way: the factor configs/engines.toml's [[nvfp4]] rows for SGLang state (now read from source).

A standalone script for SGLang's python (the venv probes/sglang_venv.sh builds; stdlib, torch and sglang only):

    bench/.sglang-venv/bin/python probes/sglang_nvfp4_loader.py CHECKPOINT_DIR

CHECKPOINT_DIR is an NVFP4 folder with ModelOpt's names (`fp8kv calibrate MODEL --kv-dtype nvfp4`). The model loads
the way loadcheck/probes/sglang.py loads it (a scheduler's start-up path, no forward pass); then SGLang's
NVFP4KVCacheMethod (fp4_kv_cache_quant_method.py) runs load_scales_from_model once with is_sm100_supported()
patched to True and once to False. Stdout is one JSON object: per GPU answer, each layer's K/V global scale as the
method holds it, its ratio to the file's, and the file's. Written against SGLang 0.5.23's source as read; not run
yet (the venv is about 11 GB): the module path and the method's constructor are looked up, and a mismatch is
an error naming what was not found.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
import types
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOADER = os.path.join(os.path.dirname(_HERE), "loadcheck", "probes", "sglang.py")
# where SGLang's NVFP4 KV method has lived in the sources read
_MODULES = ("sglang.srt.layers.quantization.fp4_kv_cache_quant_method",
            "sglang.srt.layers.quantization.kv_cache.fp4_kv_cache_quant_method",
            "sglang.srt.mem_cache.fp4_kv_cache_quant_method")


def _loader() -> Any:  # loadcheck/probes/sglang.py, loaded by path
    spec = importlib.util.spec_from_file_location("sglang_loadcheck", _LOADER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # it drops its own folder from sys.path, so `import sglang` is the package
    return module


def _method_module() -> types.ModuleType:
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"SGLang has none of {', '.join(_MODULES)}: find NVFP4KVCacheMethod and add its module")


def _method_class(module: types.ModuleType) -> type:
    found = [cls for cls in vars(module).values() if inspect.isclass(cls) and hasattr(cls, "load_scales_from_model")
             and getattr(cls, "name", None) == "nvfp4"]
    if len(found) != 1:
        raise SystemExit(f"{module.__name__}: expected one class named 'nvfp4' with load_scales_from_model, "
                         f"found {[cls.__name__ for cls in found]}")
    return found[0]


def _held(method: Any, num_layers: int) -> list[list[float]]:
    """Each layer's (K, V) global scale from the method's per-layer float32 tensors."""
    tensors = [value for value in vars(method).values()
               if hasattr(value, "shape") and tuple(value.shape) == (num_layers,) and value.dtype.is_floating_point]
    if len(tensors) != 2:
        raise SystemExit(f"{type(method).__name__}: expected a K and a V tensor of {num_layers} scales, found "
                         f"{len(tensors)}")
    return [[float(k), float(v)] for k, v in zip(tensors[0].tolist(), tensors[1].tolist())]


def main() -> int:
    loader = _loader()
    kept: dict[str, Any] = {}
    held_scales = loader.held_scales

    def keep(model: Any) -> list[dict[str, Any]]:  # the loaded model, which load() does not return
        kept["model"] = model
        return held_scales(model)

    loader.held_scales = keep
    loaded = loader.load(sys.argv[1], kv_cache_dtype="fp4_e2m1")
    file = {row["layer"]: (row["k_scale"], row["v_scale"]) for row in loaded["layers"]}
    module, model = _method_module(), kept["model"]
    cls, out = _method_class(module), {"sglang": loaded["version"], "file": file, "held": {}}
    for sm100 in (True, False):
        module.is_sm100_supported = lambda *args, answer=sm100, **kwargs: answer  # type: ignore[attr-defined]
        accepted = inspect.signature(cls).parameters
        method = cls(**{key: value for key, value in {"num_layers": len(file), "device": "cpu",
                                                      "sm_version": 100 if sm100 else 120}.items()
                        if key in accepted})
        method.load_scales_from_model(types.SimpleNamespace(model=model))
        held = _held(method, len(file))
        out["held"]["sm100" if sm100 else "sm120"] = [
            {"layer": layer, "k": k, "v": v, "k_ratio": k / file[layer][0], "v_ratio": v / file[layer][1]}
            for layer, (k, v) in zip(sorted(file), held)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
