"""The `fp8kv eval` table: one row per cache configuration, one column per task metric.

Written as `eval/results.json` (the round trip below) and `eval/results.md`; `fp8kv card` reads it back.
No lm_eval import here, so the card works without the `eval` extra.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import EVAL_DIR
from fp8kv.errors import Fp8kvError

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


@dataclass(frozen=True)
class ConfigScores:
    """One cache configuration's scores: `metrics` maps "task metric" to its value (NaN when it broke)."""

    label: str
    kv_cache: str
    scales: str
    engine: str
    metrics: dict[str, float]
    nonfinite_stored: int  # NaN/inf values the cache stored over the whole run (0 for a clamping engine)
    query: bool = False  # attention also read Q as fp8 with the checkpoint's q_scale


@dataclass(frozen=True)
class EvalResults:
    """Everything `fp8kv eval` measured: the checkpoint, the tasks, the device, and a row per configuration."""

    checkpoint: str
    tasks: tuple[str, ...]
    limit: int | None
    device: str
    rows: tuple[ConfigScores, ...]

    def to_json(self) -> str:
        data = asdict(self)
        for row in data["rows"]:  # JSON has no NaN: a broken score is null
            row["metrics"] = {k: (v if math.isfinite(v) else None) for k, v in row["metrics"].items()}
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "results.json") -> EvalResults:
        try:
            data = json.loads(text)
            rows = tuple(ConfigScores(**{**row, "metrics": {k: math.nan if v is None else float(v)
                                                            for k, v in row["metrics"].items()}})
                         for row in data["rows"])
            return cls(data["checkpoint"], tuple(data["tasks"]), data["limit"], data["device"], rows)
        except (ValueError, KeyError, TypeError) as exc:
            raise Fp8kvError(f"{source}: not an fp8kv eval result ({exc})") from None

    def markdown(self) -> str:
        """The table as Markdown: configurations down, task metrics across."""
        columns = list(dict.fromkeys(key for row in self.rows for key in row.metrics))
        header = ["cache", *columns, "NaN/inf stored"]
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for row in self.rows:
            cells = [row.label, *(_fmt(row.metrics.get(c, math.nan)) for c in columns), str(row.nonfinite_stored)]
            lines.append("| " + " | ".join(cells) + " |")
        limit = f", at most {self.limit} items per task" if self.limit else ""
        return f"lm-evaluation-harness on fp8kv's runtime ({self.device}{limit}):\n\n" + "\n".join(lines) + "\n"


def read_results(folder: str | Path) -> EvalResults | None:
    """`folder/eval/results.json`, or None when `fp8kv eval` never wrote one."""
    path = Path(folder) / EVAL_DIR / RESULTS_JSON
    if not path.is_file():
        return None
    return EvalResults.from_json(path.read_text(encoding="utf-8"), str(path))


def _fmt(value: float) -> str:
    return "NaN" if not math.isfinite(value) else f"{value:.4g}"


def metric_values(task_results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm_eval's `results` section flattened to {"task metric[,filter]": value}, stderr left out."""
    out: dict[str, float] = {}
    for task, values in task_results.items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key:
                continue
            metric, _, filter_name = key.partition(",")
            name = f"{task} {metric}" if filter_name == "none" else f"{task} {metric},{filter_name}"
            out[name] = float(value) if value is not None else math.nan
    return out
