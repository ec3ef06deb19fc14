"""Hand new K/V scales to a running vLLM engine (`LLM.collective_rpc`) and check that its attention layers hold them.

Runs in vLLM's own venv (bench/vllm_venv.sh builds bench/.vllm-venv), on two fp8kv folders of one model that differ
only in their K/V scales:

    .venv/bin/fp8kv calibrate bundled --out OLD --dataset bundled --num-samples 16 --seq-len 128 --headroom 1.25
    .venv/bin/fp8kv calibrate bundled --out NEW --dataset bundled --num-samples 16 --seq-len 128 --headroom 2
    bench/.vllm-venv/bin/python bench/vllm_live_scales.py OLD NEW --out bench/results/vllm_live_scales.json

1. live: an engine started on OLD (fp8 cache, eager) scores the prompts; `set_kv_scales_on_worker` runs on every
   worker through `collective_rpc` with NEW's scales; the engine scores them again. Where vLLM refuses the fp8 cache
   (a CPU without AVX-512 or AMX), the same update runs on the model vLLM loaded before refusing, and no prompt is
   scored. `--kv-cache-dtype bfloat16` rehearses the RPC on a bf16 cache, which does not read the scales.
2. fresh: an engine started on NEW scores the prompts: the updated engine's log-probabilities should equal these.
3. reload: vLLM's own weight reload (`reload_weights`, the function behind `collective_rpc("reload_weights")`) at
   the loader stage, from weights without scales and from weights with them: which scales the layers hold after.

Each stage runs in a child process (vLLM keeps process-wide state). The folders' scales are read with
`fp8kv inspect` (`--fp8kv`: fp8kv's command, by default the repository's .venv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The list type is a mutable sequence of items.",
           "Use the with statement to open a file and read its lines.",
           "A dictionary maps hashable keys to arbitrary values.")
Scales = dict[int, tuple[float, float]]  # layer -> (k_scale, v_scale), per tensor
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_COPIES = ("float", "tensor", "cpu")


def _layer_index(layer_name: str) -> int:
    return int(_LAYER_INDEX.search(f".{layer_name}.").group(1))


def _attention_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "_k_scale_float") and hasattr(m, "layer_name")]


def set_kv_scales(model: Any, scales: Scales) -> None:
    """Write per-tensor K/V scales into every attention layer of a loaded vLLM model, every copy vLLM's loader sets
    (BaseKVCacheMethod.process_weights_after_loading, vllm/model_executor/layers/quantization/kv_cache.py)."""
    for layer in _attention_layers(model):
        index = _layer_index(layer.layer_name)
        if index not in scales:
            raise KeyError(f"{layer.layer_name}: no scale for layer {index} in the update")
        k, v = scales[index]
        layer._k_scale.copy_(k)  # in place: a captured CUDA graph keeps reading this tensor's storage
        layer._v_scale.copy_(v)
        layer._k_scale_cpu.fill_(k)  # host copies, for backends that take the scale on the host
        layer._v_scale_cpu.fill_(v)
        layer._k_scale_float = k  # what vLLM's CPU attention passes its kernels on every call
        layer._v_scale_float = v


def held_scales(model: Any) -> dict[int, dict[str, float]]:
    """Every copy of each attention layer's K and V scale: `k_float` (`_k_scale_float`), `k_tensor` (`_k_scale`),
    `k_cpu` (`_k_scale_cpu`), the same for V."""
    held = {}
    for layer in _attention_layers(model):
        held[_layer_index(layer.layer_name)] = {
            "k_float": float(layer._k_scale_float), "k_tensor": float(layer._k_scale), "k_cpu": float(layer._k_scale_cpu),
            "v_float": float(layer._v_scale_float), "v_tensor": float(layer._v_scale), "v_cpu": float(layer._v_scale_cpu)}
    return dict(sorted(held.items()))


def set_kv_scales_on_worker(worker: Any, scales: Scales) -> None:
    """For `llm.collective_rpc(set_kv_scales_on_worker, args=(scales,))`: vLLM calls it with each worker."""
    set_kv_scales(worker.get_model(), scales)


def held_scales_on_worker(worker: Any) -> dict[int, dict[str, float]]:
    return held_scales(worker.get_model())


def holds(held: dict[int, dict[str, float]], scales: Scales) -> bool:
    """Whether every copy of every layer's scales is the given float32, bit for bit (as `fp8kv load-check`)."""
    def bits(x: float) -> bytes:
        return struct.pack("<d", x)

    return bool(held) and held.keys() == scales.keys() and all(
        bits(copies[f"{part}_{copy}"]) == bits(scales[layer][i])
        for layer, copies in held.items() for i, part in enumerate("kv") for copy in _COPIES)


def _prompt_logprobs(llm: Any, prompts: list[str]) -> list[list[float]]:
    """Each prompt token's log-probability after the first, greedy, as vLLM scores the prompt."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    return [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
            for out in outputs]


def _engine(path: str, kv_cache_dtype: str) -> Any:
    from vllm import LLM

    return LLM(model=path, kv_cache_dtype=kv_cache_dtype, enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)


def _keep_loaded_model(into: list[Any]) -> None:
    """Have vLLM's loader hand over the model once its weights are processed (before start-up can refuse)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def spy(model: Any, model_config: Any, target_device: Any) -> None:
        original(model, model_config, target_device)
        into.append(model)

    base_loader.process_weights_after_loading = spy


def _first_raised(exc: BaseException) -> BaseException:
    """The exception raised first, however vLLM wrapped it."""
    while exc.__cause__ or exc.__context__:
        exc = exc.__cause__ or exc.__context__
    return exc


def _refusal(exc: BaseException) -> dict[str, str]:
    """What vLLM raised first: its type, text and the source line that raised it."""
    exc = _first_raised(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = frame.filename[frame.filename.rfind("/vllm/") + 1:]
    return {"type": type(exc).__name__, "message": str(exc), "where": f"{where}:{frame.lineno}", "function": frame.name}


def stage_live(spec: dict[str, Any]) -> dict[str, Any]:
    """Engine on OLD: held scales and prompt log-probabilities, the update by RPC, both again; or, where vLLM
    refuses to start, the update on the model it loaded."""
    new = {int(layer): tuple(pair) for layer, pair in spec["new"].items()}
    loaded: list[Any] = []
    _keep_loaded_model(loaded)
    try:
        llm = _engine(spec["old_path"], spec["kv_cache_dtype"])
    except Exception as exc:  # the point is to record what vLLM says, whatever it raises
        if not loaded:
            raise
        held_loaded = held_scales(loaded[0])
        set_kv_scales(loaded[0], new)
        return {"where": "loader stage", "refusal": _refusal(exc), "held_loaded": held_loaded,
                "held_updated": [held_scales(loaded[0])], "logprobs_before": None, "logprobs_after": None}
    held_loaded = llm.collective_rpc(held_scales_on_worker)[0]
    before = _prompt_logprobs(llm, spec["prompts"])
    llm.collective_rpc(set_kv_scales_on_worker, args=(new,))
    llm.reset_prefix_cache()  # cached blocks were quantized with the old scales
    held_updated = llm.collective_rpc(held_scales_on_worker)
    return {"where": "running engine", "refusal": None, "held_loaded": held_loaded, "held_updated": held_updated,
            "logprobs_before": before, "logprobs_after": _prompt_logprobs(llm, spec["prompts"])}


def stage_fresh(spec: dict[str, Any]) -> dict[str, Any]:
    """Engine on NEW: held scales and prompt log-probabilities."""
    llm = _engine(spec["new_path"], spec["kv_cache_dtype"])
    return {"held": llm.collective_rpc(held_scales_on_worker)[0], "logprobs": _prompt_logprobs(llm, spec["prompts"])}


class _Stop(Exception):
    """Raised in the loader once the reloads are done: the rest of start-up is not needed."""


def stage_reload(spec: dict[str, Any]) -> dict[str, Any]:
    """OLD loaded with an fp8 cache, then vLLM's `reload_weights` three times at the loader stage; after each, what
    the layers hold. The reloads, in order: the source model's weights (no scales), NEW's scale tensors alone, and
    OLD's folder (weights and scales)."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader import base_loader, get_model_loader
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    held: dict[str, Any] = {}
    original = base_loader.process_weights_after_loading

    def scale_tensors(path: str, model: Any) -> list[tuple[str, Any]]:
        config = get_current_vllm_config()
        config.model_config.model = path
        weights = get_model_loader(config.load_config).get_all_weights(config.model_config, model)
        return [(name, tensor) for name, tensor in weights if name.rsplit(".", 1)[-1] in ("k_scale", "v_scale")]

    def spy(model: Any, model_config: Any, target_device: Any) -> None:
        original(model, model_config, target_device)
        config = get_current_vllm_config()
        held["after loading OLD"] = held_scales(model)
        reload_weights(config, model, None, spec["source_path"], True)
        held["source weights (no scales)"] = held_scales(model)
        reload_weights(config, model, scale_tensors(spec["new_path"], model), None, True)
        held["NEW's scale tensors alone"] = held_scales(model)
        reload_weights(config, model, None, spec["old_path"], True)
        held["OLD's folder (weights, scales)"] = held_scales(model)
        raise _Stop

    base_loader.process_weights_after_loading = spy
    try:
        _engine(spec["old_path"], "fp8")
    except Exception as exc:  # _Stop, however vLLM wraps it
        if not isinstance(_first_raised(exc), _Stop):
            raise
    return held


STAGES = {"live": stage_live, "fresh": stage_fresh, "reload": stage_reload}


def run_stage(name: str, spec: dict[str, Any], timeout: int) -> dict[str, Any]:
    """One stage in a child process; its result, or {"error": ...} with the child's last line."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--stage", name, "--spec", json.dumps(spec), "--result", str(result)]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no answer in {timeout} s"}
        if not result.exists():
            lines = [line for line in child.stderr.splitlines() if line.strip()]
            return {"error": lines[-1] if lines else f"exited with status {child.returncode}"}
        return json.loads(result.read_text(), object_hook=_int_keys)


def _int_keys(obj: dict[str, Any]) -> dict[Any, Any]:
    return {int(k) if k.isdigit() else k: v for k, v in obj.items()}


def file_scales(folder: Path, fp8kv: Path) -> Scales:
    """The per-tensor K/V scales `fp8kv inspect` reads from `folder`, by layer."""
    done = subprocess.run([str(fp8kv), "inspect", str(folder), "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{fp8kv} inspect {folder}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    report = json.loads(done.stdout)
    scales = {row["layer"]: (row["k_scale"], row["v_scale"]) for row in report["layers"]}
    if not all(isinstance(x, float) for pair in scales.values() for x in pair):
        raise SystemExit(f"{folder}: per-head scales; vLLM keeps one K and one V scale per layer")
    return scales


def machine() -> dict[str, Any]:
    import torch
    import vllm

    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "cpu_flags": {flag: flag in flags for flag in ("avx512f", "amx_tile")}, "load_average": os.getloadavg()}


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def verdict(live: dict[str, Any], fresh: dict[str, Any] | None, kv_cache_dtype: str) -> dict[str, Any]:
    """The prompt log-probability comparison, or why it did not run."""
    if live["logprobs_before"] is None:
        refusal = live["refusal"]
        return {"ran": False, "reason": f"vLLM refused to start: {refusal['type']}: {refusal['message']} "
                                        f"({refusal['where']}, {refusal['function']})"}
    if fresh is None or "error" in fresh:
        return {"ran": False, "reason": f"the engine on the new scales did not start: {(fresh or {}).get('error')}"}
    after_vs_fresh = max_difference(live["logprobs_after"], fresh["logprobs"])
    before_vs_after = max_difference(live["logprobs_before"], live["logprobs_after"])
    scales_read = kv_cache_dtype.startswith("fp8")  # a bf16 cache does not read the scales: nothing may move
    predicted = after_vs_fresh == 0 and (before_vs_after > 0) == scales_read
    return {"ran": True, "after_update_vs_fresh_new": after_vs_fresh, "before_vs_after_update": before_vs_after,
            "expected": "0 and > 0" if scales_read else "0 and 0 (the cache does not read the scales)",
            "as_predicted": predicted}


def report(result: dict[str, Any], old: Scales, new: Scales) -> str:
    live, lines = result["live"], [f"vLLM {result['machine']['vllm']}, torch {result['machine']['torch']}, "
                                   f"CPU flags {result['machine']['cpu_flags']}, load {result['machine']['load_average']}"]
    lines.append(f"update ({live['where']}, {result['kv_cache_dtype']} cache), K/V scales per layer:")
    lines.append(f"{'layer':>5} {'part':>4}  {'old file':>20} {'held loaded':>20} {'new file':>20} "
                 f"{'held updated float':>20} {'held updated tensor':>20}")
    for layer in sorted(new):
        for i, part in enumerate("kv"):
            updated = live["held_updated"][0][layer]
            lines.append(f"{layer:>5} {part:>4}  {old[layer][i]!r:>20} {live['held_loaded'][layer][f'{part}_float']!r:>20} "
                         f"{new[layer][i]!r:>20} {updated[f'{part}_float']!r:>20} {updated[f'{part}_tensor']!r:>20}")
    lines.append(f"every layer holds the new file's scales bit for bit after the update: {result['update_holds_new']}")
    logprobs = result["logprobs"]
    if logprobs["ran"]:
        lines.append(f"prompt logprobs: max |after update - fresh engine on new| = {logprobs['after_update_vs_fresh_new']!r}, "
                     f"max |before - after update| = {logprobs['before_vs_after_update']!r} "
                     f"(expected {logprobs['expected']}): {'as predicted' if logprobs['as_predicted'] else 'NOT as predicted'}")
    else:
        lines.append(f"prompt logprobs: NOT RUN: {logprobs['reason']}")
    lines.append("vLLM's reload_weights at the loader stage (fp8 cache), in order:")
    for name, outcome in result["reload"].items():
        lines.append(f"  {name:<34} {outcome}")
    return "\n".join(lines)


def reload_outcomes(reload: dict[str, Any], old: Scales, new: Scales) -> dict[str, str]:
    """Per reload: whose scales the layers hold afterwards."""
    if "error" in reload:
        return {"error": reload["error"]}
    return {name: "holds the old scales" if holds(held, old) else "holds the new scales" if holds(held, new)
            else "holds other scales" for name, held in reload.items()}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("old", type=Path, nargs="?", help="fp8kv folder the engine starts on")
    options.add_argument("new", type=Path, nargs="?", help="fp8kv folder of the same model with the new scales")
    options.add_argument("--out", type=Path, help="where to write the results JSON")
    options.add_argument("--kv-cache-dtype", default="fp8", help="fp8 (the check) or bfloat16 (the RPC alone: a bf16 cache does not read the scales)")
    options.add_argument("--prompt", action="append", help="a prompt to score (repeatable; default: three of its own)")
    options.add_argument("--fp8kv", type=Path, default=REPO / ".venv" / "bin" / "fp8kv", help="fp8kv's command")
    options.add_argument("--timeout", type=int, default=600)
    options.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    options.add_argument("--spec", help=argparse.SUPPRESS)
    options.add_argument("--result", help=argparse.SUPPRESS)
    args = options.parse_args()
    if args.stage:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: the spy sees it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        Path(args.result).write_text(json.dumps(STAGES[args.stage](json.loads(args.spec))))
        sys.stdout.flush()
        os._exit(0)  # a half-started engine: its exit handlers have nothing to shut down, and can hang
    if args.old is None or args.new is None:
        options.error("give the OLD and NEW fp8kv folders")

    old, new = file_scales(args.old, args.fp8kv), file_scales(args.new, args.fp8kv)
    source = json.loads((args.old / "fp8kv.json").read_text())["source"]["path"]
    spec = {"old_path": str(args.old.resolve()), "new_path": str(args.new.resolve()), "source_path": source,
            "new": new, "prompts": args.prompt or list(PROMPTS), "kv_cache_dtype": args.kv_cache_dtype}
    result: dict[str, Any] = {"machine": machine(), "kv_cache_dtype": args.kv_cache_dtype, "old": str(args.old),
                              "new": str(args.new), "old_scales": old, "new_scales": new}
    live = run_stage("live", spec, args.timeout)
    if "error" in live:
        raise SystemExit(f"the engine on {args.old} did not load: {live['error']}")
    fresh = run_stage("fresh", spec, args.timeout) if live["logprobs_before"] is not None else None
    result |= {"live": live, "fresh": fresh, "logprobs": verdict(live, fresh, args.kv_cache_dtype),
               "update_holds_new": all(holds(held, new) for held in live["held_updated"]),
               "reload": reload_outcomes(run_stage("reload", spec, args.timeout), old, new)}
    result["machine"]["load_average_after"] = os.getloadavg()
    print(report(result, old, new))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
