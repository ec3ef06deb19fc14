"""Hand new K/V scales to a running vLLM engine (`fp8kv.api.send_scales`) and check what its attention layers
hold (`fp8kv.api.check_engine_scales`), and what vLLM's own weight reload does to them.

Runs in vLLM's own venv (probes/vllm_venv.sh builds bench/.vllm-venv) with fp8kv installed there
(`bench/.vllm-venv/bin/pip install --no-deps -e .`), on two fp8kv folders of one model that differ only in their
K/V scales:

    .venv/bin/fp8kv calibrate bundled --out OLD --dataset bundled --num-samples 16 --seq-len 128 --headroom 1.25
    .venv/bin/fp8kv calibrate bundled --out NEW --dataset bundled --num-samples 16 --seq-len 128 --headroom 2
    bench/.vllm-venv/bin/python probes/vllm_live_scales.py OLD NEW --out bench/results/vllm_live_scales.json

1. live: an engine started on OLD (fp8 cache, eager) scores the prompts; NEW's scales go to every worker through
   `collective_rpc`; the engine scores them again. `--kv-cache-dtype bfloat16` rehearses the RPC on a bf16 cache,
   which does not read the scales. Where vLLM refuses the fp8 cache (a CPU without AVX-512 or AMX), what it raised.
2. fresh: an engine started on NEW scores the prompts: the updated engine's log-probabilities should equal these.
3. reload: on a running engine on OLD, vLLM's `collective_rpc("reload_weights")` from the source model's weights
   (no scales), from NEW's scale tensors alone, and from OLD's folder: which scales the layers hold after each.

Each stage runs in a child process (one engine per process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from outputs import write_json  # probes/outputs.py

PROMPTS = ("The list type is a mutable sequence of items.",
           "Use the with statement to open a file and read its lines.",
           "A dictionary maps hashable keys to arbitrary values.")
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what vLLM's CPU attention picks its ISA by


def prompt_logprobs(llm: Any, prompts: list[Any]) -> list[list[float]]:
    """Each prompt token's log-probability after the first, as vLLM scores the prompt (texts or token-id prompts)."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    return [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
            for out in outputs]


def engine(path: str, kv_cache_dtype: str) -> Any:
    """vLLM's offline engine on `path`, eager (no graph keeps an old scale), in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc calls the workers in place
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(model=path, kv_cache_dtype=kv_cache_dtype, enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)


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


def _checked(llm: Any, sent: Path) -> dict[str, Any]:
    """`check_engine_scales` against the scales of the folder `sent`, as JSON."""
    from fp8kv import api
    from fp8kv.checkpoint.reader import read_kv_scales
    from fp8kv.json_fields import to_json_value

    found = api.check_engine_scales(llm, read_kv_scales(sent).scales)
    return {"ok": found.ok, "text": api.render_engine_check(found), "check": to_json_value(found)}


def stage_live(spec: dict[str, Any]) -> dict[str, Any]:
    """Engine on OLD: what it holds and its prompt log-probabilities, NEW's scales sent, both again."""
    from fp8kv import api
    from fp8kv.checkpoint.reader import read_kv_scales

    try:
        llm = engine(spec["old_path"], spec["kv_cache_dtype"])
    except Exception as exc:  # the point is to record what vLLM says, whatever it raises
        return {"refusal": _refusal(exc)}
    loaded = _checked(llm, Path(spec["old_path"]))
    before = prompt_logprobs(llm, spec["prompts"])
    api.send_scales(llm, read_kv_scales(spec["new_path"]).scales)
    return {"refusal": None, "loaded_holds_old": loaded, "updated_holds_new": _checked(llm, Path(spec["new_path"])),
            "logprobs_before": before, "logprobs_after": prompt_logprobs(llm, spec["prompts"])}


def stage_fresh(spec: dict[str, Any]) -> dict[str, Any]:
    """Engine on NEW: what it holds and its prompt log-probabilities."""
    llm = engine(spec["new_path"], spec["kv_cache_dtype"])
    return {"holds_new": _checked(llm, Path(spec["new_path"])), "logprobs": prompt_logprobs(llm, spec["prompts"])}


def _scale_tensors(folder: str) -> list[tuple[str, Any]]:
    """The K/V scale tensors of `folder`'s safetensors files, under the checkpoint's names."""
    from safetensors.torch import load_file

    return [(name, tensor) for path in sorted(Path(folder).glob("*.safetensors"))
            for name, tensor in load_file(path).items() if name.rsplit(".", 1)[-1] in ("k_scale", "v_scale")]


def stage_reload(spec: dict[str, Any]) -> dict[str, Any]:
    """Engine on OLD (fp8 cache), then `collective_rpc("reload_weights")` three times; after each, whether the
    layers hold OLD's or NEW's scales. In order: the source model's weights (no scales), NEW's scale tensors
    alone, OLD's folder (weights and scales)."""
    llm = engine(spec["old_path"], "fp8")
    old, new = Path(spec["old_path"]), Path(spec["new_path"])
    reloads = (("source weights (no scales)", {"weights_path": spec["source_path"]}),
               ("NEW's scale tensors alone", {"weights_iterator": _scale_tensors(spec["new_path"])}),
               ("OLD's folder (weights, scales)", {"weights_path": spec["old_path"]}))
    held = {}
    for name, kwargs in reloads:
        llm.collective_rpc("reload_weights", kwargs=kwargs)
        held[name] = {"holds_old": _checked(llm, old)["ok"], "holds_new": _checked(llm, new)["ok"]}
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
        return json.loads(result.read_text())


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else ())
             if line.startswith("model name")]
    return names[0] if names else platform.processor()


def machine() -> dict[str, Any]:
    import torch
    import transformers
    import vllm

    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "transformers": transformers.__version__, "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "cpu_model": cpu_model(), "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
            "load_average": os.getloadavg()}


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def verdict(live: dict[str, Any], fresh: dict[str, Any] | None, kv_cache_dtype: str) -> dict[str, Any]:
    """The prompt log-probability comparison, or why it did not run."""
    if live["refusal"] is not None:
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


def report(result: dict[str, Any]) -> str:
    m, live = result["machine"], result["live"]
    lines = [f"vLLM {m['vllm']}, torch {m['torch']}, {m['cpu_model']}, CPU flags {m['cpu_flags']}, "
             f"load {m['load_average']}, {result['kv_cache_dtype']} cache"]
    if live["refusal"] is None:
        lines += [f"engine on OLD holds OLD's scales as loaded: {live['loaded_holds_old']['ok']}",
                  "after send_scales with NEW's:", live["updated_holds_new"]["text"]]
    logprobs = result["logprobs"]
    if logprobs["ran"]:
        lines.append(f"prompt logprobs: max |after update - fresh engine on new| = {logprobs['after_update_vs_fresh_new']!r}, "
                     f"max |before - after update| = {logprobs['before_vs_after_update']!r} "
                     f"(expected {logprobs['expected']}): {'as predicted' if logprobs['as_predicted'] else 'NOT as predicted'}")
    else:
        lines.append(f"prompt logprobs: NOT RUN: {logprobs['reason']}")
    lines.append("vLLM's reload_weights through collective_rpc on a running engine (fp8 cache), in order:")
    reload = result["reload"]
    if "error" in reload:
        lines.append(f"  error: {reload['error']}")
    for name, held in ({} if "error" in reload else reload).items():
        whose = "OLD's" if held["holds_old"] else "NEW's" if held["holds_new"] else "other"
        lines.append(f"  {name:<34} the layers hold {whose} scales")
    return "\n".join(lines)


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("old", type=Path, nargs="?", help="fp8kv folder the engine starts on")
    options.add_argument("new", type=Path, nargs="?", help="fp8kv folder of the same model with the new scales")
    options.add_argument("--out", type=Path, help="where to write the results JSON")
    options.add_argument("--kv-cache-dtype", default="fp8", help="fp8 (the check) or bfloat16 (the RPC alone: a bf16 cache does not read the scales)")
    options.add_argument("--prompt", action="append", help="a prompt to score (repeatable; default: three of its own)")
    options.add_argument("--timeout", type=int, default=600)
    options.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    options.add_argument("--spec", help=argparse.SUPPRESS)
    options.add_argument("--result", help=argparse.SUPPRESS)
    args = options.parse_args()
    if args.stage:
        Path(args.result).write_text(json.dumps(STAGES[args.stage](json.loads(args.spec))))
        sys.stdout.flush()
        os._exit(0)  # a running or half-started engine: its exit handlers can hang
    if args.old is None or args.new is None:
        options.error("give the OLD and NEW fp8kv folders")

    source = json.loads((args.old / "fp8kv.json").read_text())["source"]["path"]
    spec = {"old_path": str(args.old.resolve()), "new_path": str(args.new.resolve()), "source_path": source,
            "prompts": args.prompt or list(PROMPTS), "kv_cache_dtype": args.kv_cache_dtype}
    result: dict[str, Any] = {"machine": machine(), "kv_cache_dtype": args.kv_cache_dtype, "old": str(args.old),
                              "new": str(args.new)}
    live = run_stage("live", spec, args.timeout)
    if "error" in live:
        raise SystemExit(f"the engine on {args.old} did not load: {live['error']}")
    fresh = run_stage("fresh", spec, args.timeout) if live["refusal"] is None else None
    result |= {"live": live, "fresh": fresh, "logprobs": verdict(live, fresh, args.kv_cache_dtype),
               "reload": run_stage("reload", spec, args.timeout)}
    result["machine"]["load_average_after"] = os.getloadavg()
    print(report(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
