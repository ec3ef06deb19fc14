"""The verify driver: static checks, held-out statistics, runtime checks, verdict, report.

    from fp8kv.verify.request import VerifyRequest
    from fp8kv.verify.run import verify
    result = verify(VerifyRequest(Path("ckpt"), data=DataRequest("heldout.jsonl", num_samples=16)))
    result.verdict, result.exit_code, result.report_dir
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fp8kv.data import CalibrationData, repeated_prefixes
from fp8kv.engine_models import (
    VLLM_TPU, CheckpointTraits, EngineModel, engine_model, engine_of, judged_paths, release_name,
)
from fp8kv.data import load_tokenizer
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.checkpoint.artifacts import VERIFY_DIR, check_writable_location, is_fp8kv_output
from fp8kv.checkpoint.digest import checkpoint_digest
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.load import WeightsMismatch
from fp8kv.inspection import scale_rows
from fp8kv.checkpoint.hub_cache import looks_like_hub_id, repo_id_from_cache_path, split_hub_id
from fp8kv.progress import StageProgress, announce, stage_callback
from fp8kv.runtime import amx_tiles, xla_cost
from fp8kv.serving import loss_line
from fp8kv.runtime.device import resolve_device
from fp8kv.verify import accuracy, engines, fidelity, generation, heldout, nvfp4
from fp8kv.verify.request import VerifyRequest, check_verify_request
from fp8kv.verify.report import REPORT_JSON, HeldOut, VerifyReport, write_report
from fp8kv.verify.results import LayerCheck, QueryCost
from fp8kv.verify.static import StaticResult, static_checks
from fp8kv.verify.tpu import tpu_kernel_reasons
from fp8kv.checks import FAIL, INFO, WARN, Finding
from fp8kv.verify.verdict import (
    EXIT_CODES, Thresholds, clamped_nan_reasons, engine_accuracy_reasons, heldout_reasons, load_thresholds, verdict,
)

DEFAULT_REPORT_ROOT = "fp8kv-verify"


@dataclass(frozen=True)
class VerifyResult:
    """The verdict, its exit code (`ExitCode`), the report, and where it was written."""

    verdict: str
    exit_code: int
    report: VerifyReport
    report_dir: Path


def verify(request: VerifyRequest, progress: StageProgress | None = None) -> VerifyResult:
    """Check the checkpoint's KV scales statically and on held-out text; write report.md/json and scales.png."""
    check_verify_request(request)
    thresholds = request.thresholds or load_thresholds()
    runtime = resolve_device(request.device)
    model_dir = resolve_model(str(request.model_dir))
    report_dir = report_location(str(request.model_dir), model_dir, request.report_dir)
    check_writable_location(report_dir / REPORT_JSON)  # before the work, so its results are never lost
    clock = time.perf_counter()
    announce(progress, "static checks")
    static = static_checks(model_dir, any(engine_of(name) == VLLM_TPU for name in request.engines))
    if static.readout.nvfp4 is not None:  # before the work: each path's scale depends on the convention
        nvfp4.known_convention(static)
        nvfp4.check_device(runtime)
    reasons, held_out, timings = list(static.reasons), HeldOut(), {}
    if static.runnable:
        tokenizer, data = _heldout_text(request, static, runtime.kind, progress)
        held_out = HeldOut(heldout.text_source(data), len(data.samples), data.num_tokens,
                           sum(repeated_prefixes(data.samples)))
        try:
            if static.readout.nvfp4 is not None:  # its cache per engine path, not the fp8 engines
                held_out, found, timings = nvfp4.heldout_checks(request, static, data, thresholds, held_out, progress)
            else:
                held_out, found, timings = _heldout_checks(request, static, tokenizer, data, runtime.kind,
                                                           thresholds, held_out, progress)
            reasons += found
        except WeightsMismatch as exc:  # numbers from invented weights would judge nothing
            reasons.append(Finding(FAIL, f"{exc}; held-out checks skipped"))
    else:
        reasons.append(Finding(FAIL, "held-out checks skipped: the scales cannot drive an fp8 cache"))
    timings["total"] = time.perf_counter() - clock
    report = build_report(static, runtime.kind, thresholds, reasons, held_out, timings)
    announce(progress, f"writing the report to {report_dir}")
    write_report(report, report_dir)
    return VerifyResult(report.verdict, report.exit_code, report, report_dir)


def build_report(static: StaticResult, device: str, thresholds: Thresholds, reasons: list[Finding],
                 held_out: HeldOut, timings: dict[str, float]) -> VerifyReport:
    """The report of one run: the static part, what the held-out checks measured, and the verdict `reasons` give."""
    outcome, readout = verdict(reasons), static.readout
    return VerifyReport(
        checkpoint=str(readout.source.path),
        # Exactly what was judged: card and push refuse this report once the folder differs.
        digest=checkpoint_digest(readout.source.path),
        device=device, convention=static.convention, kv_dtype=readout.kv_dtype, thresholds=thresholds,
        static=static.summary(), scales=scale_rows(readout.scales), held_out=held_out,
        verdict=outcome, exit_code=EXIT_CODES[outcome], timings_s=timings, reasons=tuple(reasons),
    )


def report_location(model: str, model_dir: Path, requested: Path | None) -> Path:
    """`--report`; else DIR/verify when fp8kv wrote DIR; else ./fp8kv-verify/NAME, never inside a user's folder
    or the Hub cache."""
    if requested is not None:
        return Path(requested)
    if is_fp8kv_output(model_dir) and repo_id_from_cache_path(model_dir) is None:  # a Hub cache is not ours
        return model_dir / VERIFY_DIR
    name = split_hub_id(model)[0].replace("/", "--") if looks_like_hub_id(model) else Path(model).resolve().name
    return Path.cwd() / DEFAULT_REPORT_ROOT / (name or "model")


def _heldout_text(request: VerifyRequest, static: StaticResult, device: str,
                  progress: StageProgress | None) -> tuple[Any, CalibrationData]:
    """The checkpoint's tokenizer and the held-out samples it reads (the data note goes to `progress`)."""
    tokenizer = load_tokenizer(static.readout.source.path, False)
    announce(progress, "loading held-out text")
    data = heldout.load_heldout(request.data, tokenizer, static.readout.source, "cuda" if device == "cuda" else "cpu")
    if data.note and progress is not None:
        progress.note(data.note)
    return tokenizer, data


def _heldout_checks(request: VerifyRequest, static: StaticResult, tokenizer: Any, data: CalibrationData, device: str,
                    thresholds: Thresholds, text: HeldOut, progress: StageProgress | None
                    ) -> tuple[HeldOut, list[Finding], dict[str, float]]:
    """Run the caches and engine models over held-out text (the bf16 one also measures max |x|/scale), compare
    generations.

    Returns `text` (what was read) with what was measured, the findings, and the seconds each phase took.
    """
    source, scales = static.readout.source, static.readout.scales
    assert scales is not None  # runnable implies scales
    kv_layers = source.geometry.kv_layers
    reasons = [Finding(WARN, note) for note in [heldout.calibration_overlap(source, data)] if note]
    timings: dict[str, float] = {}

    clock = time.perf_counter()
    prompts = _prompts(request, data, tokenizer)
    longest = max(max(len(s) for s in data.samples), max(len(p) for p in prompts) + request.new_tokens)
    xla = resolve_device(request.device).is_xla
    compiles_before = xla_cost.compiles() if xla else None
    announce(progress, f"loading the model and the fp8 runtime ({device})")
    serving = serving_models(request.engines, static)
    reasons += loader_reasons(serving)
    runners = accuracy.Runners.open(
        source.path, scales, kv_layers, device=request.device, page_size=request.page_size,
        max_model_len=longest, max_num_seqs=max(request.batch_size, 2 * len(prompts)),
        engines=serving, engine_attention=request.engine_attention,
    )
    timings["load_runners"] = time.perf_counter() - clock
    if xla or not runners.fp8.runs_ragged:
        reasons += _own_attention_notes(request.engine_attention, serving, runners.fp8.arithmetic,
                                        "torch_xla's attention runs on an XLA device" if runners.fp8.runs_ragged
                                        else f"{source.geometry.model_type} attends in its own code or over MLA latents")

    reasons += _slow_tile_sums_note(runners)
    readback = accuracy.readback(runners.fp8, scales)
    if not readback.equal:
        reasons.append(Finding(FAIL, "the runtime's scales differ from the file's: "
                                    + "; ".join(readback.mismatches[:3])))
    reference = fidelity.measure_fidelity(runners.bf16, data.samples)
    if reference.refuses:  # fp8 against a runtime that is not the model would judge the runtime
        return replace(text, readback=readback, fidelity=reference), reasons + reference.reasons(), timings
    reasons += reference.reasons()

    clock = time.perf_counter()
    measured, engine_results = accuracy.measure_accuracy(
        runners, data.samples, request.batch_size,
        stage_callback(progress, "bf16 / fp8 / unit-scale caches and engine models (samples)"))
    shares = accuracy.cache_shares(runners.fp8)
    # the bf16 cache has seen exactly the held-out text so far (generation comes later): its amax is the text's
    rows = heldout.max_ratio_rows(runners.bf16.counts().amax, scales, kv_layers)
    timings["accuracy"] = time.perf_counter() - clock
    query, query_reasons, query_seconds = _query_cost(request, runners, scales, data.samples, measured.kl_mean)
    reasons += query_reasons
    if query_seconds is not None:
        timings["query"] = query_seconds
    layers = tuple(LayerCheck.of(row, shares[row.layer]) for row in rows)

    clock = time.perf_counter()
    announce(progress, f"greedy generation ({len(prompts)} prompts x {request.new_tokens} tokens)")
    matched, details = generation.compare_generation(runners.bf16, runners.fp8, prompts, request.new_tokens)
    timings["generation"] = time.perf_counter() - clock
    nan_with_clamp = {row.layer: row.nan_with_clamp for row in layers if row.nan_with_clamp}
    reasons += clamped_nan_reasons(nan_with_clamp) + engine_accuracy_reasons(engine_results, thresholds)
    worst_ratio = max((max(row.k_max_ratio, row.v_max_ratio) for row in layers), default=0.0)
    # each names the fix
    engine_failures = engines.engine_reasons(engine_results, worst_ratio, scales.fp8_max, static.headroom)
    reasons += engine_failures + heldout_reasons(layers, thresholds, scales.fp8_max, with_fix=not engine_failures,
                                                 headroom=static.headroom)
    reasons += tpu_kernel_reasons(device, source.geometry, runners.fp8.calls, request.engines)
    measured_all = replace(
        text, accuracy=measured, generation=matched, readback=readback, layers=layers,
        runtime=xla_cost.summarize(runners.fp8, prompts[0], compiles_before),
        engines=tuple(engine_results),
        query=query, fidelity=reference, generation_details=details,
    )
    return measured_all, reasons, timings


def _own_attention_notes(engine_attention: bool, serving: tuple[EngineModel, ...], arithmetic: str,
                         why: str) -> list[Finding]:
    """INFO where no engine's attention arithmetic can be reproduced here (`why`): for --engine-attention, and for
    each hardware path whose read would differ."""
    notes = [Finding(INFO, f"--engine-attention: {why}, so every engine model attends in {arithmetic} here and only "
                           "its write is its own")] if engine_attention else []
    return notes + [Finding(INFO, f"engine {m.name}: {why}, so this path's attention ({m.attention}) is not "
                                  f"reproduced: it attends in {arithmetic} here, like the release's other paths",
                            (m.name,)) for m in serving if m.path is not None and m.attention]


def _slow_tile_sums_note(runners: accuracy.Runners) -> list[Finding]:
    """INFO where an engine path's flushing tile sums run in torch on the CPU, not compiled: the same figures,
    slower. (A GPU's tensors always sum in torch.)"""
    paths = [name for name, runner in runners.engines.items()
             if runner.arithmetic == "vllm-cpu-amx" and runner.device.type == "cpu"]
    route = amx_tiles.tile_sums_route() if paths else ""
    return [Finding(INFO, f"engine {', '.join(paths)}: its flushing tile sums run in {route}: the same figures, each "
                          "attention call about 3x slower than through the compiled kernel", tuple(paths))
            ] if route.startswith("torch") else []


def serving_models(names: tuple[str, ...], static: StaticResult) -> tuple[EngineModel, ...]:
    """The engine models of `names` as each would serve this checkpoint, every hardware path of a release on its own
    (`judged_paths`): at scale 1.0 where its scales would not reach that release's cache (a convention it does not
    read, a model path that never reads them)."""
    readout = static.readout
    assert readout.scales is not None  # runnable implies scales
    architectures = readout.source.config.get("architectures") or ()
    traits = CheckpointTraits(tuple(architectures), tuple(readout.conventions), readout.scales.strategy != "tensor",
                              str(readout.source.path))
    models = {path.name: path for name in names for path in judged_paths(engine_model(name))}
    return tuple(model.for_checkpoint(traits) for model in models.values())


def loader_reasons(models: tuple[EngineModel, ...]) -> list[Finding]:
    """FAIL for each engine release whose own loader did not start on this model class with these scales (a
    calibrated output must never keep a model from serving); INFO for each whose loader fp8kv has not run on it. A
    loader is the release's, whatever path reads the cache: one line per release, naming it."""
    releases = {(release_name(m.name), m.starts, m.unchecked): replace(m, name=release_name(m.name))
                for m in models}.values()
    reasons = [Finding(FAIL, f"engine {loss_line(m)}", (m.name,)) for m in releases if not m.starts]
    return reasons + [Finding(INFO, f"engine {loss_line(m)}", (m.name,)) for m in releases if m.unchecked]


def _query_cost(request: VerifyRequest, runners: accuracy.Runners, scales: KVScales, samples: list[list[int]],
                kl_mean_kv_only: float) -> tuple[QueryCost | None, list[Finding], float | None]:
    """With --quantize-query: the accuracy cost of also quantizing Q with q_scale, the findings, and its seconds."""
    if not request.quantize_query:
        return None, [], None
    if scales.q is None:
        return None, [Finding(WARN, "--quantize-query: the checkpoint has no q_scale (calibrate with --attention fp8)")
                      ], None
    clock = time.perf_counter()
    query = accuracy.query_cost(request.model_dir, runners, scales, samples, request.batch_size, kl_mean_kv_only)
    return query, [], time.perf_counter() - clock


def _prompts(request: VerifyRequest, data: CalibrationData, tokenizer: Any) -> list[list[int]]:
    if request.prompts is not None:
        return generation.read_prompts(Path(request.prompts), tokenizer)
    return [sample[: request.prompt_len] for sample in data.samples[: request.num_prompts]]
