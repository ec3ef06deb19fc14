"""`fp8kv eval`: the same lm_eval tasks on a bf16 cache and on fp8 caches (unit and checkpoint scales, per engine).

    from fp8kv.evaluation.request import EvalRequest
    result, folder = evaluate(EvalRequest(Path("ckpt"), tasks=("fp8kv_pydoc_mc",), limit=20))

One copy of the weights serves every configuration; only the cache differs between runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.artifacts import write_file_atomic
from fp8kv.checkpoint.provenance import record_written
from fp8kv.errors import Fp8kvError
from fp8kv.evaluation.request import EvalRequest, check_eval_request
from fp8kv.evaluation.results import RESULTS_JSON, RESULTS_MD, ConfigScores, EvalResults, metric_values
from fp8kv.evaluation.spec import CacheSpec


def cache_specs(model_dir: Path, engines: tuple[str, ...]) -> list[CacheSpec]:
    """bf16, then per engine fp8 with unit scales and (when the checkpoint has scales) its own, and with Q in fp8
    too when it has query scales."""
    scales = read_kv_scales(model_dir).scales
    specs = [CacheSpec.parse("bf16")]
    for engine in engines:
        specs.append(CacheSpec.parse("fp8", "unit", engine))
        if scales is not None:
            specs.append(CacheSpec.parse("fp8", "checkpoint", engine))
        if scales is not None and scales.q is not None:
            specs.append(CacheSpec.parse("fp8", "checkpoint", engine, query=True))
    return specs


def evaluate(request: EvalRequest, progress: Callable[[str, int, int], None] | None = None) -> tuple[EvalResults, Path]:
    """Run the tasks on every cache configuration; write results.json and results.md; return them and the folder.

    `progress(stage, done, total)` hears of each configuration, under one stage name for the whole run.
    """
    import logging

    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    from fp8kv.evaluation.bundled_tasks import TASKS_DIR
    from fp8kv.evaluation.harness import Fp8kvLM
    from fp8kv.runtime.device import resolve_device
    from fp8kv.runtime.runner import load_model

    folder = check_eval_request(request)
    model_dir = resolve_model(str(request.model_dir))
    specs = cache_specs(model_dir, request.engines)
    include = [str(TASKS_DIR)] + ([str(request.include_path)] if request.include_path else [])
    # lm_eval's own tasks (thousands of files, seconds to index) only when one of them is asked for
    manager = TaskManager(include_path=include, include_defaults=False)
    if not set(request.tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=include)
    unknown = sorted(set(request.tasks) - set(manager.all_tasks))
    if unknown:
        raise Fp8kvError(f"unknown lm_eval task(s) {', '.join(unknown)}; see `lm_eval ls tasks` or pass --include-path")
    runtime = resolve_device(request.device)
    model = load_model(model_dir, runtime.device)
    if not logging.getLogger("lm_eval").isEnabledFor(logging.WARNING):
        # lm_eval asks git for the commit of the folder it runs in, for a results field fp8kv does not keep;
        # outside a repository git prints "fatal: not a git repository" once per configuration.
        lm_eval.evaluator.get_git_commit_hash = lambda: None
    rows = []
    stage = f"lm_eval on {len(specs)} cache configurations"
    for done, spec in enumerate(specs):
        if progress is not None:
            progress(stage, done, len(specs))
        lm = Fp8kvLM(str(model_dir), spec.kv_cache, spec.scales, spec.engine, spec.query, device=runtime.kind,
                     batch_size=request.batch_size, max_length=request.max_length, model=model)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(request.tasks), limit=request.limit, task_manager=manager,
                                      log_samples=False, bootstrap_iters=0)
        nonfinite = sum(k + v for k, v in lm.runner.counts().nonfinite.values())
        rows.append(ConfigScores(spec.label, spec.kv_cache, spec.scales, spec.engine,
                                 metric_values(out["results"]), nonfinite, spec.query))
        del lm  # free this configuration's cache before the next one is allocated
    if progress is not None:
        progress(stage, len(specs), len(specs))
    result = EvalResults(str(model_dir), tuple(request.tasks), request.limit, runtime.kind, tuple(rows))
    folder.mkdir(parents=True, exist_ok=True)
    write_file_atomic(folder / RESULTS_JSON, result.to_json().encode())
    write_file_atomic(folder / RESULTS_MD, result.markdown().encode())
    record_written(folder / RESULTS_JSON, folder / RESULTS_MD)
    return result, folder
