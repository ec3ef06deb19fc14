"""Does vLLM load what fp8kv writes? Tiny checkpoints of every architecture family, calibrated, converted to
every format, each loaded by vLLM itself (probes/vllm_load_check.py, in vLLM's own venv), which reports the
scale every attention layer holds against the file's.

    probes/vllm_venv.sh                     # once: bench/.vllm-venv with vLLM's CPU build
    .venv/bin/python probes/vllm_loading.py # prints the table, writes bench/results/vllm_loading.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fp8kv.calibrate.pipeline import calibrate
from fp8kv.calibrate.request import CalibrationRequest
from fp8kv.checkpoint.convert import convert_checkpoint
from fp8kv.data import DataRequest
from fp8kv.errors import Fp8kvError
from fp8kv.inspection import inspect_checkpoint
from fp8kv.models import BUNDLED_CALIBRATION_TEXT
from fp8kv.tools.factory import make_checkpoint
from fp8kv.tools.zoo import make_zoo_checkpoint

HERE = Path(__file__).parent
BENCH = HERE.parent / "bench"  # its results/ and the vLLM venv (probes/vllm_venv.sh)
RESULTS = BENCH / "results" / "vllm_loading.json"
FACTORY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
ZOO = ("gpt2", "gpt_neox", "falcon", "deepseek_v3")  # transformers' own tiny configs; deepseek_v3 is MLA
# vLLM's CPU attention takes head sizes from 32 up: the zoo's 16-wide heads are widened (4 heads of 32)
_ZOO_WIDTH = {
    "gpt2": {"n_embd": 128},
    "gpt_neox": {"hidden_size": 128},
    "falcon": {"hidden_size": 128, "ffn_hidden_size": 512},  # vLLM's falcon.py builds a 4 x hidden MLP regardless
    "deepseek_v3": {"kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
                    "head_dim": 32, "topk_method": "noaux_tc"},  # noaux_tc: vLLM then expects the routing bias
}
CONVERTED = ("modelopt", "quark", "vllm-json")


def build(arch: str, root: Path) -> Path:
    """A tiny bf16 checkpoint of `arch` (the test factory's, or the zoo's for families the factory lacks)."""
    import torch

    if arch in FACTORY:
        return make_checkpoint(arch, root / arch, dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    return make_zoo_checkpoint(arch, root / arch, overrides=_ZOO_WIDTH[arch])


def calibrated(source: Path, out: Path, attention: str = "kv") -> Path:
    """`source` calibrated on the bundled calibration text (a few short samples), written as compressed-tensors."""
    data = DataRequest(dataset=str(BUNDLED_CALIBRATION_TEXT), num_samples=8, seq_len=64)
    calibrate(CalibrationRequest(model=str(source), out=out, data=data, batch_size=4, attention=attention,
                                 device="cpu"))
    return out


def file_scales(folder: Path) -> dict[str, dict[str, float | None]]:
    """The scales `fp8kv inspect` reads from `folder`, per layer (per-tensor: one value each)."""
    report = inspect_checkpoint(folder)
    return {str(row.layer): {"k": row.k_scale, "v": row.v_scale, "q": row.q_scale} for row in report.layers}


def cases(archs: list[str], root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (architecture, format) folder to load, with the scales its files hold; and the conversions
    fp8kv refuses (MLA has a scale name only in compressed-tensors), as result rows."""
    found, refused = [], []
    for arch in archs:
        source = build(arch, root / "src")
        base = calibrated(source, root / f"{arch}-compressed-tensors")
        outputs = {"compressed-tensors": base}
        for convention in CONVERTED:
            try:
                outputs[convention] = convert_checkpoint(base, root / f"{arch}-{convention}", convention)
            except Fp8kvError as exc:
                refused.append({"name": f"{arch} {convention}", "arch": arch, "format": convention,
                                "status": "fp8kv refuses", "error": str(exc).split("; ", 1)[-1], "layers": [],
                                "log": []})
        if arch == "llama":
            outputs["compressed-tensors +q"] = calibrated(source, root / "llama-attention-fp8", attention="fp8")
        for fmt, folder in outputs.items():
            found.append({"name": f"{arch} {fmt}", "arch": arch, "format": fmt, "path": str(folder),
                          "file": file_scales(folder), "engine_args": {}})
    return found, refused


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per (architecture, format): status, layer 0's file and held k/v scales, vLLM's words."""
    lines = ["| architecture | format | vLLM loads | layers exact | layer 0 k file → vLLM | layer 0 v file → vLLM "
             "| q | vLLM says |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        exact = sum(layer["exact"] for layer in row["layers"])
        first = row["layers"][0] if row["layers"] and row["layers"][0]["vllm_k"] is not None else None
        k = f"{first['file_k']:.6g} → {first['vllm_k']:.6g}" if first else "–"
        v = f"{first['file_v']:.6g} → {first['vllm_v']:.6g}" if first else "–"
        q = f"{first['file_q']:.6g} → {first['vllm_q']:.6g}" if first and first["file_q"] is not None else ""
        said = row["error"] if not row["layers"] or row["status"] == "load failed" else "; ".join(row["log"])
        lines.append(f"| {row['arch']} | {row['format']} | {row['status']} | {exact}/{len(row['layers'])} | {k} "
                     f"| {v} | {q} | {said.replace('|', '/')[:200]} |")
    return "\n".join(lines)


def cell(row: dict[str, Any]) -> str:
    """What vLLM held for one folder, in a few words: exact, bf16 (largest relative error), 1.0, or the failure."""
    if row["status"] == "exact":
        return f"exact {len(row['layers'])}/{len(row['layers'])}"
    if row["status"] == "bf16-rounded":
        return f"bf16-rounded (≤ {max(layer['rel_err'] for layer in row['layers']):.2%})"
    if row["status"] == "ignored (1.0)":
        return "1.0 (scales ignored)"
    if row["status"] == "fp8kv refuses":
        return "fp8kv refuses"
    return f"fails: {(row['error'] or '').split(' The available')[0][:90]}"


def summary(rows: list[dict[str, Any]]) -> str:
    """Architectures down, formats across: what vLLM held (see `cell`)."""
    formats = list(dict.fromkeys(row["format"] for row in rows))
    by = {(row["arch"], row["format"]): row for row in rows}
    lines = ["| architecture | " + " | ".join(formats) + " |", "|---" * (len(formats) + 1) + "|"]
    for arch in dict.fromkeys(row["arch"] for row in rows):
        cells = [cell(by[arch, f]).replace("|", "/") if (arch, f) in by else "" for f in formats]
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def show(paths: list[Path]) -> None:
    """Print the summary and the per-layer table of saved results files, rows of later files replacing earlier."""
    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        results = json.loads(path.read_text())
        print(f"{path}: vLLM {results['meta']['vllm']} ({results['meta']['machine']}), load {results['meta']['load']}")
        rows.update((row["name"], row) for row in results["rows"])
    print(summary(list(rows.values())) + "\n\n" + markdown(list(rows.values())))


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--archs", nargs="*", default=[*FACTORY, *ZOO])
    options.add_argument("--vllm-python", default=str(BENCH / ".vllm-venv" / "bin" / "python"))
    options.add_argument("--work", help="keep the checkpoints here (default: a temporary folder)")
    options.add_argument("--results", type=Path, default=RESULTS)
    options.add_argument("--show", type=Path, nargs="+", help="only print the tables of these results files")
    args = options.parse_args()
    if args.show:
        show(args.show)
        return 0
    if not Path(args.vllm_python).exists():
        print(f"{args.vllm_python}: not found; build it with probes/vllm_venv.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        manifest = root / "manifest.json"
        loads, refused = cases(args.archs, root)
        manifest.write_text(json.dumps(loads, indent=2))
        args.results.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PJRT_DEVICE")}
        subprocess.run([args.vllm_python, str(HERE / "vllm_load_check.py"), str(manifest), "--out", str(args.results)],
                       check=True, env=env)
    results = json.loads(args.results.read_text())
    results["rows"] += refused
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    show([args.results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
