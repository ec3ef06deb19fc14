"""What an eval run is asked to do: the options of `fp8kv eval`, as one frozen type, importable without torch
or lm_eval (the command line reads its defaults from here before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8kv.checkpoint.artifacts import EVAL_DIR, PROVENANCE_FILE, is_fp8kv_output
from fp8kv.engine_models import EVAL_ENGINES
from fp8kv.errors import Fp8kvError
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


def report_folder(model_dir: Path, report_dir: Path | None) -> Path:
    """--report, else DIR/eval; writing inside DIR only when fp8kv wrote DIR (its fp8kv.json is there)."""
    if report_dir is not None:
        return Path(report_dir)
    if not is_fp8kv_output(model_dir):
        raise Fp8kvError(f"{model_dir}: not written by fp8kv (no {PROVENANCE_FILE}); pass --report FOLDER "
                         "so nothing is added to a checkpoint fp8kv does not own")
    return Path(model_dir) / EVAL_DIR


def check_eval_request(request: EvalRequest) -> Path:
    """Refuse a --limit below 1 and results written into a folder fp8kv did not write; return the results folder.
    Needs neither torch nor lm_eval: the command line runs it before they load."""
    if request.limit is not None and request.limit < 1:
        raise Fp8kvError(f"--limit must be at least 1, got {request.limit}")
    return report_folder(request.model_dir, request.report_dir)
