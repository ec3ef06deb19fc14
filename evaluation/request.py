"""What an eval run is asked to do: the options of `fp8kv eval`, as one frozen type, importable without torch
or lm_eval (the command line reads its defaults from here before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8kv.engine_models import EVAL_ENGINES
from fp8kv.evaluation.bundled_tasks import BUNDLED_TASKS


@dataclass(frozen=True)
class EvalRequest:
    """What `fp8kv eval` runs: tasks (lm_eval names; the bundled ones need no include path) on every cache;
    `fp8kv eval` takes its defaults from here."""

    model_dir: Path
    tasks: tuple[str, ...] = BUNDLED_TASKS
    limit: int | None = None
    engines: tuple[str, ...] = EVAL_ENGINES
    device: str = "auto"
    batch_size: int = 8
    max_length: int | None = None
    include_path: Path | None = None
    report_dir: Path | None = None  # None: DIR/eval when fp8kv wrote DIR
