"""`fp8kv load-check`: load a checkpoint with a serving engine's own loader, in the engine's Python, and compare
the K/V scale each attention layer holds with the file's.

The engine runs in a subprocess (`probes/<engine>.py`, run by the engine's Python: engines pin their own
torch) that prints one JSON object: `{"engine", "version", "torch", "layers": [{"layer", "k_scale",
"v_scale", ...}], "warnings"}`. No torch here.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

from fp8kv.checkpoint.reader import ScaleReadout, read_kv_scales
from fp8kv.console import markdown_table
from fp8kv.engine_models import (
    HOLDS_FILE, HOLDS_NONE, HOLDS_ONE, HOLDS_OTHER, HOLDS_ROUNDED, REACHES_CACHE, CheckpointTraits, loader_release, route,
)
from fp8kv.errors import Fp8kvError, UsageError
from fp8kv.inspection import Scale, scale_rows
from fp8kv.json_fields import checked, json_object, to_json_value, typed
from fp8kv.kvdtypes import VLLM_KV_CACHE_DTYPE
from fp8kv.options import LoadEngine

LOAD_ENGINES: tuple[str, ...] = get_args(LoadEngine)
PROBES = Path(__file__).parent / "probes"
DEFAULT_TIMEOUT_S = 600.0
# "rounded": every held value within one bf16 step of the file's (the engine kept it in the model's dtype)
_BF16_STEP = 2.0**-8
# How each engine's --kv-cache-dtype spells fp8kv's kv dtype: vLLM says "fp8" for e4m3, SGLang uses fp8kv's names.
_KV_CACHE_DTYPE = {"vllm": VLLM_KV_CACHE_DTYPE, "sglang": {kv: kv for kv in VLLM_KV_CACHE_DTYPE}}
# The engine's process gets only what running it needs: never a token or key from this one.
_PASSED_ENV = ("PATH", "HOME", "USER", "LANG", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
               "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_PASSED_PREFIXES = ("LC_", "VLLM_", "SGLANG_")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class LayerLoad:
    """One attention layer: its K/V scales in the file and as the engine holds them (None: the file has no
    scale for the layer, or the engine no such layer; a tuple: one per KV head)."""

    layer: int
    file_k: Scale | None
    file_v: Scale | None
    held_k: Scale | None
    held_v: Scale | None

    @property
    def comparable(self) -> bool:
        """Whether file and engine hold the same kind of scale (per tensor, or per head for as many heads)."""
        return all(_shape(f) is not None and _shape(f) == _shape(h)
                   for f, h in ((self.file_k, self.held_k), (self.file_v, self.held_v)))

    @property
    def matches(self) -> bool:
        """Whether the engine holds the file's K and V values bit for bit."""
        return self.comparable and _same(self.file_k, self.held_k) and _same(self.file_v, self.held_v)

    @property
    def holds_one(self) -> bool:
        """Whether the engine holds 1.0 for K and V where the file has other values: it did not load them."""
        return self.held_k == 1.0 and self.held_v == 1.0 and not self.matches


@dataclass(frozen=True)
class LoadCheckReport:
    """What `fp8kv load-check` found: the engine and torch versions, each attention layer's file and held scales,
    and the engine's warnings about scales and the KV cache."""

    engine: str
    engine_version: str
    torch_version: str
    checkpoint: str
    layers: tuple[LayerLoad, ...]
    warnings: tuple[str, ...]
    route: str = ""  # where the file's scales do not reach the cache: the way that does, from fp8kv's loader matrix

    @property
    def ok(self) -> bool:
        """Whether every layer holds the file's scales (the CLI exits 3 when not)."""
        return bool(self.layers) and all(layer.matches for layer in self.layers)

    @property
    def holds(self) -> str:
        """What the attention layers hold, over all of them: HOLDS_FILE, HOLDS_ROUNDED, HOLDS_ONE, HOLDS_NONE or
        HOLDS_OTHER."""
        layers = self.layers
        if all(row.held_k is None and row.held_v is None for row in layers):
            return HOLDS_NONE
        if self.ok:
            return HOLDS_FILE
        if all(row.holds_one for row in layers):
            return HOLDS_ONE
        if layers and all(row.comparable and _close(row.file_k, row.held_k) and _close(row.file_v, row.held_v)
                          for row in layers):
            return HOLDS_ROUNDED
        return HOLDS_OTHER


def load_check(checkpoint: Path, engine: str, python: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> LoadCheckReport:
    """Load `checkpoint` with `engine`'s own loader, run by the `python` of the engine's venv, and compare what
    each attention layer holds with the file's scales. An engine that cannot be run raises `Fp8kvError`."""
    if engine not in LOAD_ENGINES:
        raise UsageError(f"--engine {engine!r}: load-check runs {' or '.join(LOAD_ENGINES)}")
    readout = read_kv_scales(checkpoint)
    answer = _run_probe(engine, Path(python), readout, timeout_s)
    report = report_from(engine, readout, answer, Path(python))
    release = loader_release(engine, report.engine_version)
    # the matrix knows one scale per layer: no route for per-head scales
    if readout.scales is None or readout.scales.strategy != "tensor" or report.holds in REACHES_CACHE or not release:
        return report
    traits = CheckpointTraits(tuple(readout.source.config.get("architectures") or ()), tuple(readout.conventions),
                              False, str(readout.source.path))
    return replace(report, route=route(release, traits))


def _run_probe(engine: str, python: Path, readout: ScaleReadout, timeout_s: float) -> dict[str, Any]:
    """The probe's JSON object, run by `python` on the checkpoint; any failure is one `Fp8kvError` line."""
    if readout.nvfp4 is not None:  # its probes load fp8 caches; SGLang's NVFP4 loader has a probe of its own
        raise Fp8kvError(f"{readout.source.path}: holds {readout.kv_dtype} scales, and load-check loads fp8 caches "
                         "only; probes/sglang_nvfp4_loader.py runs SGLang's NVFP4 loader (docs/nvfp4.md)")
    if not python.exists():
        raise Fp8kvError(f"{python}: no such file; give --python the python of a venv with {engine} installed")
    if python.is_dir() or not os.access(python, os.X_OK):
        raise Fp8kvError(f"{python}: not an executable python")
    # absolute, not resolved: the engine runs in a scratch folder, and a venv's python is a link that must stay one
    command = [str(python.absolute()), str(PROBES / f"{engine}.py"), str(readout.source.path),
               "--kv-cache-dtype", _KV_CACHE_DTYPE[engine][readout.kv_dtype]]
    with tempfile.TemporaryDirectory(prefix="fp8kv-load-check-") as scratch:  # whatever the engine leaves in its cwd
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=_engine_env(),
                                  cwd=scratch, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            took = f"{engine} did not finish loading {readout.source.path} in {timeout_s:g} s"
            raise Fp8kvError(f"{python}: {took}") from None
        except OSError as exc:
            raise Fp8kvError(f"{python}: cannot be run ({exc.strerror or exc})") from None
    if done.returncode != 0:
        said = _last_line(done.stderr) or f"exited with status {done.returncode} and printed nothing"
        raise Fp8kvError(f"{python}: {said}")
    try:
        return json_object(json.loads(done.stdout), "the probe's output")
    except (json.JSONDecodeError, TypeError):
        raise Fp8kvError(f"{python}: the {engine} probe printed no JSON object: {done.stdout[:200]!r}") from None


def _engine_env() -> dict[str, str]:
    """This process's environment, cut to what running an engine needs, offline."""
    passed = {key: value for key, value in os.environ.items()
              if (key in _PASSED_ENV or key.startswith(_PASSED_PREFIXES))
              and not any(word in key.upper() for word in _SECRET_WORDS)}
    return passed | _OFFLINE_ENV


def report_from(engine: str, readout: ScaleReadout, answer: dict[str, Any], python: Path) -> LoadCheckReport:
    """A probe's answer (its JSON object) set against the file's scales, layer by layer over both."""
    try:
        held = {typed(row, "layer", int): (_scale(row, "k_scale"), _scale(row, "v_scale"))
                for row in typed(answer, "layers", list)}
        versions = typed(answer, "version", str), typed(answer, "torch", str)
        warnings = tuple(checked(line, str, "a warning") for line in typed(answer, "warnings", list))
    except (TypeError, KeyError) as exc:
        raise Fp8kvError(f"{python}: the {engine} probe's JSON is not what load-check reads ({exc})") from None
    in_file = {row.layer: (row.k_scale, row.v_scale) for row in scale_rows(readout.scales)}
    layers = tuple(LayerLoad(i, *in_file.get(i, (None, None)), *held.get(i, (None, None)))
                   for i in sorted(held.keys() | in_file.keys()))
    return LoadCheckReport(engine, *versions, str(readout.source.path), layers, warnings)


def _scale(row: Any, key: str) -> Scale | None:
    """A held scale: a float, a list per head, or null for none (SGLang leaves a scale it did not load unset)."""
    value = typed(row, key, (int, float, list), optional=True)
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(float(checked(x, (int, float), f"an item of {key!r}")) for x in value)
    return float(value)


def _shape(scale: Scale | None) -> int | None:
    """1 for a per-tensor scale, the number of heads for a per-head one, None for none."""
    return None if scale is None else 1 if isinstance(scale, float) else len(scale)


def _values(scale: Scale | None) -> tuple[float, ...]:
    return () if scale is None else (scale,) if isinstance(scale, float) else scale


def _close(a: Scale | None, b: Scale | None) -> bool:
    """Within one bf16 step of each other, value by value."""
    return all(abs(x - y) <= _BF16_STEP * abs(x) for x, y in zip(_values(a), _values(b), strict=True))


def _same(a: Scale | None, b: Scale | None) -> bool:
    """Bit for bit (a float32 is exact in a double, so an engine's float32 compares through its double's bytes)."""
    def bits(scale: Scale | None) -> list[bytes]:
        return [struct.pack("<d", x) for x in _values(scale)]

    return bits(a) == bits(b)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def render(report: LoadCheckReport) -> str:
    """The report as text: one row per layer (file and held K/V, whether it holds the file's), the engine's
    warnings, and a last line saying how many layers hold the file's value."""
    head = ["layer", "k_scale file", "k_scale held", "v_scale file", "v_scale held", "holds the file's"]
    rows = [[str(row.layer), _exact(row.file_k), _exact(row.held_k), _exact(row.file_v), _exact(row.held_v),
             _verdict(row)] for row in report.layers]
    lines = [f"{report.engine} {report.engine_version} (torch {report.torch_version}) loaded {report.checkpoint}"]
    lines += [markdown_table(head, rows)] if rows else []
    lines += [f"warning: {note}" for note in report.warnings]
    lines += [f"route: {report.route}"] if report.route else []
    return "\n".join([*lines, summary(report)])


def _verdict(row: LayerLoad) -> str:
    if row.matches:
        return "yes"
    if row.file_k is None:
        return "no scale in the file"
    return "no" if row.comparable or row.held_k is None else "not comparable"


def summary(report: LoadCheckReport) -> str:
    """One line: how many layers hold the file's value, and what the others say."""
    layers, engine = report.layers, report.engine
    if not layers:
        return f"{engine} reported no attention layers: nothing to compare"
    text = f"{sum(row.matches for row in layers)} of {len(layers)} layers hold the file's value"
    if report.holds == HOLDS_ROUNDED:
        text += f"; every layer holds it rounded (within a bf16 step: {engine} keeps it in the model's dtype)"
    ones = sum(row.holds_one for row in layers)
    if not any(row.file_k is not None for row in layers):
        text += f"; the checkpoint has no KV scales and {ones} hold 1.0" if ones else "; the checkpoint has no KV scales"
    elif ones:
        text += f"; {ones} hold 1.0: {engine} did not load the scales"
    unset = sum(row.file_k is not None and row.held_k is None and row.held_v is None for row in layers)
    if unset:
        text += f"; {unset} hold no scale: {engine} did not load them"
    if any(isinstance(row.file_k, tuple) and _shape(row.held_k) == 1 for row in layers):
        text += f"; the file has per-head scales and {engine} holds one per layer: not comparable"
    return text


def _exact(scale: Scale | None) -> str:
    """Every digit of a float (a held scale one float32 step off must read differently); per-head values as a
    list."""
    if scale is None:
        return "-"
    return repr(scale) if isinstance(scale, float) else "[" + ", ".join(map(repr, scale)) + "]"


def to_json(report: LoadCheckReport) -> str:
    """The `--json` object: the report's fields, `ok`, and per layer whether it `matches`."""
    value = to_json_value(report)
    value["ok"] = report.ok
    for row, layer in zip(value["layers"], report.layers):
        row["matches"] = layer.matches
    return json.dumps(value, indent=2)
