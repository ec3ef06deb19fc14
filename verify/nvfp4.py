"""verify of an NVFP4 folder, per engine path: each `[[nvfp4]]` row of configs/engines.toml (release, GPU
generations, cache write) runs the NVFP4 cache (`runtime.nvfp4_cache`: vLLM's `nvfp4` or `nvfp4_4over6` write) with
the global scale that path really holds, the stored value times its loader's factor, and the read its attention
takes (sm100 dequantizes the blocks into e4m3: the "fp8" read; sm80, sm90 and sm120 read them dequantized,
"float32"). An fp8_k_nvfp4_v folder, which no release read serves (`[[fp8_k_nvfp4_v]]`), runs one path of fp8kv's
own arithmetic. Each is scored on the held-out text against the bf16 cache and against the fp8 cache at fp8kv's fp8
scales of the same observation, and its scales against the same path at global scale 1.0 (what an uncalibrated
NVFP4 cache runs), judged as one family with the fp8 rows' false-alarm control. A path whose global scale is 6x off
is a finding naming it, with the convert that gives it amax / 448 where one does.
"""

from __future__ import annotations

import math
import shlex
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.kvscales import KVScales, float32
from fp8kv.checkpoint.nvfp4 import MODELOPT, Nvfp4Convention, convention_for_factor, converted
from fp8kv.checks import FAIL, INFO, WARN, Finding
from fp8kv.data import CalibrationData, repeated_prefixes
from fp8kv.engine_models import FP8_K_NVFP4_V_RELEASES, NVFP4_LOADERS, Nvfp4Loader, Nvfp4Traits
from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import E2M1_MAX, SCALE_BOUND
from fp8kv.options import DEFAULT_KV_DTYPE, FP8_K_NVFP4_V
from fp8kv.progress import StageProgress, announce
from fp8kv.runtime.device import RuntimeDevice, resolve_device
from fp8kv.runtime.nvfp4_cache import Nvfp4Counts, Nvfp4PagedKVCache
from fp8kv.runtime.runner import PagedModelRunner, load_model
from fp8kv.serving import NO_FP8_K_NVFP4_V_RELEASE, nvfp4_traits_of
from fp8kv.verify import fidelity, heldout
from fp8kv.verify.accuracy import ScoredSample, SequenceScore, Totals, prefill
from fp8kv.verify.report import HeldOut
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.results import Accuracy, Nvfp4Check, Nvfp4PathResult, Nvfp4Writes, VersusFp8
from fp8kv.verify.nvfp4_report import unit_family
from fp8kv.verify.static import StaticResult
from fp8kv.verify.verdict import Thresholds, unit_scale_reasons, verdict

# What a calibrated amax maps to (amax / 448): the global scale every path should run
BOUND = SCALE_BOUND["nvfp4"]


def known_convention(static: StaticResult) -> Nvfp4Convention:
    """The one NVFP4 convention of the folder; an error where its files do not tell."""
    readout = static.readout
    reading = readout.nvfp4
    assert reading is not None  # an NVFP4 folder
    where = readout.source.path
    if reading.known is None:
        raise Fp8kvError(f"{where}: its files do not say whether the global scales are stored as "
                         f"{' or '.join(reading.conventions)} ({reading.why}), and each path's scale depends on it; "
                         "fp8kv inspect shows both readings")
    return reading.known


def check_device(device: RuntimeDevice) -> None:
    """No TPU engine has an NVFP4 cache, and fp8kv's runs in torch on a CPU or CUDA device only."""
    if device.is_xla:
        raise Fp8kvError(f"--device {device.kind}: an NVFP4 cache runs on cpu or cuda here (no TPU engine has "
                         "one); pass --device cpu or --device cuda")


@dataclass(frozen=True)
class Nvfp4Path:
    """One path verify runs: its name, how fp8kv knows it, the cache it writes (`runtime.nvfp4_cache`), the read
    its attention takes ("fp8" or "float32"), and the global scale it holds: the stored one where it `loads` them,
    times `factor` (a stored 1.0 kept where `keeps_unit`), else 1.0 (`not_loaded` says how it leaves them out)."""

    name: str
    known_by: str
    cache: str
    read: str
    loads: bool
    factor: float
    keeps_unit: bool
    not_loaded: str = ""

    @classmethod
    def of(cls, loader: Nvfp4Loader, traits: Nvfp4Traits) -> Nvfp4Path:
        """The path of one `[[nvfp4]]` row for a checkpoint of `traits`."""
        not_loaded = loader.not_loaded(traits)
        return cls(loader.name, loader.known_by, loader.write, "fp8" if loader.fp8_dequant else "float32",
                   not not_loaded, loader.factor, loader.keeps_unit, not_loaded)


# fp8_k_nvfp4_v's one path, no release's: the stored scales as they are, K written as the fp8 cache verify compares
# with writes it, V as vLLM's nvfp4 write, both read back in float32, as fp8kv's own fp8 cache is
OWN_FP8_K_NVFP4_V = Nvfp4Path("fp8kv's own fp8 K / nvfp4 V (no release)", "fp8kv's own arithmetic", FP8_K_NVFP4_V,
                              "float32", True, 1.0, False)


def nvfp4_paths(kv_dtype: str, traits: Nvfp4Traits) -> tuple[Nvfp4Path, ...]:
    """The paths verify runs for a folder of `kv_dtype` and `traits`: each `[[nvfp4]]` row whose release starts that
    cache, or fp8kv's own for fp8_k_nvfp4_v."""
    if kv_dtype == FP8_K_NVFP4_V:
        return (OWN_FP8_K_NVFP4_V,)
    return tuple(Nvfp4Path.of(loader, traits) for loader in NVFP4_LOADERS if not loader.refused(traits))


def refused_paths(kv_dtype: str, traits: Nvfp4Traits) -> list[Finding]:
    """An INFO per `[[nvfp4]]` row whose release does not start the cache for this model: no path to judge."""
    if kv_dtype == FP8_K_NVFP4_V:
        return []
    return [Finding(INFO, f"{loader.name} does not start this model's NVFP4 cache: {why}; it is not judged",
                    engines=(loader.name,))
            for loader in NVFP4_LOADERS if (why := loader.refused(traits))]


def global_scales(path: Nvfp4Path, stored: tuple[float, ...]) -> tuple[float, ...]:
    """The global scale `path` holds per layer for the `stored` values: each times its factor in float32, a stored
    1.0 kept where its loader keeps it; 1.0 where it does not load them."""
    if not path.loads:
        return tuple(1.0 for _ in stored)
    return tuple(s if path.keeps_unit and s == 1.0 else float32(s * path.factor) for s in stored)


def runs_divisor(path: Nvfp4Path, convention: Nvfp4Convention) -> float:
    """The path's global scale as amax x headroom / this; 0.0 where it does not load the scales."""
    return convention.divisor / path.factor if path.loads else 0.0


def fix_command(folder: Path, path: Nvfp4Path) -> str | None:
    """The convert that stores the scales so that `path` runs amax / 448, as a command to type; None where no
    convention does."""
    row = convention_for_factor(path.factor)
    if row is None:
        return None
    return f"fp8kv convert {shlex.quote(str(folder))} --to {row.name} --out {shlex.quote(f'{folder}-{row.name}')}"


def heldout_checks(request: VerifyRequest, static: StaticResult, data: CalibrationData, thresholds: Thresholds,
                   text: HeldOut, progress: StageProgress | None) -> tuple[HeldOut, list[Finding], dict[str, float]]:
    """Run the bf16, fp8 and each path's NVFP4 cache over the held-out text; `text` with what was measured, the
    findings, and the seconds each phase took."""
    convention = known_convention(static)
    source, scales = static.readout.source, static.readout.scales
    assert scales is not None  # runnable implies scales
    reasons = [Finding(WARN, note) for note in [heldout.calibration_overlap(source, data)] if note]
    clock, timings = time.perf_counter(), {}
    announce(progress, f"loading the model and the NVFP4 runtime ({resolve_device(request.device).kind})")
    device = request.device
    model = load_model(source.path, resolve_device(device).device)
    common: dict[str, Any] = dict(device=device, model=model, page_size=request.page_size,
                                  max_num_seqs=request.batch_size, max_model_len=max(len(s) for s in data.samples))
    layers = source.geometry.kv_layers
    fp8_scales = _fp8_scales(scales, convention)
    bf16 = PagedModelRunner(source.path, cache_dtype="bf16", **common)
    fp8 = PagedModelRunner(source.path, cache_dtype=DEFAULT_KV_DTYPE, k_scales=_per_layer(fp8_scales.k),
                           v_scales=_per_layer(fp8_scales.v), **common)
    fp8_unit = PagedModelRunner(source.path, cache_dtype=DEFAULT_KV_DTYPE, **common)
    traits = nvfp4_traits_of(source.path)
    judged = nvfp4_paths(static.readout.kv_dtype, traits)
    reasons += refused_paths(static.readout.kv_dtype, traits)
    runs = path_runs(judged, source.path, scales, layers, common)
    timings["load_runners"] = time.perf_counter() - clock
    reference = fidelity.measure_fidelity(bf16, data.samples)
    if reference.refuses:  # NVFP4 against a runtime that is not the model would judge the runtime
        return replace(text, fidelity=reference), reasons + reference.reasons(), timings
    reasons += reference.reasons()

    clock = time.perf_counter()
    caches = list({id(cache): cache for run in runs for cache in (run.cache, run.unit)}.values())
    path_count = "1 path" if len(runs) == 1 else f"{len(runs)} paths"
    announce(progress, f"bf16 / fp8 / {len(caches)} NVFP4 caches for {path_count} ({len(data.samples)} samples)")
    references, scores, seconds = score(bf16, fp8, fp8_unit, caches, data.samples, request.batch_size)
    timings["accuracy"] = time.perf_counter() - clock
    timings["prefill bf16 / fp8 / fp8 at 1.0"] = seconds[id(bf16)]
    timings |= {f"prefill {_cache_label(runs, cache)}": seconds[id(cache)] for cache in caches}
    results = [Nvfp4PathResult(run.path.name, run.path.known_by, run.path.read, run.path.loads, run.path.factor,
                               run.k, run.v, _writes(run.cache),
                               references.accuracy(scores[id(run.cache)], scores[id(run.unit)],
                                                   paired=run.cache is not run.unit),
                               references.versus_fp8(scores[id(run.cache)]), "PASS")
               for run in runs]
    found = path_reasons(judged, results, convention, source.path, thresholds, references.fp8)
    paths = tuple(replace(r, verdict=verdict([f for f in found if r.path in f.engines])) for r in results)
    check = Nvfp4Check(convention.name, convention.divisor, references.fp8, paths, static.readout.kv_dtype)
    return replace(text, fidelity=reference, nvfp4=check), reasons + found, timings


@dataclass(frozen=True)
class PathRun:
    """One path, the global scales it holds per KV layer, its NVFP4 cache and the same cache at global scale 1.0."""

    path: Nvfp4Path
    k: tuple[float, ...]
    v: tuple[float, ...]
    cache: PagedModelRunner
    unit: PagedModelRunner


def path_runs(judged: tuple[Nvfp4Path, ...], model_dir: Path, scales: KVScales, layers: tuple[int, ...],
              common: dict[str, Any]) -> list[PathRun]:
    """A run per path; paths holding the same scales with the same cache and read share one runner. The fp8 read
    quantizes Q with q_scale (1.0 where the folder has none, as an engine without one holds)."""
    q = {layer: scales.q_value(layer) for layer in layers} if scales.q is not None else dict.fromkeys(layers, 1.0)
    caches: dict[tuple[str, str, tuple[float, ...], tuple[float, ...]], PagedModelRunner] = {}

    def cache(path: Nvfp4Path, k: tuple[float, ...], v: tuple[float, ...]) -> PagedModelRunner:
        key = (path.cache, path.read, k, v)
        if key not in caches:
            caches[key] = PagedModelRunner(
                model_dir, cache_dtype=path.cache, nvfp4_read=path.read, k_scales=dict(zip(layers, k)),
                v_scales=dict(zip(layers, v)), q_scales=q if path.read == "fp8" else None, **common)
        return caches[key]

    stored_k, stored_v = tuple(scales.k[i][0] for i in layers), tuple(scales.v[i][0] for i in layers)
    unit = tuple(1.0 for _ in layers)
    runs = []
    for path in judged:
        k, v = global_scales(path, stored_k), global_scales(path, stored_v)
        runs.append(PathRun(path, k, v, cache(path, k, v), cache(path, unit, unit)))
    return runs


@dataclass(frozen=True)
class Scores:
    """One NVFP4 cache's score of each held-out sequence against the bf16 cache's logits and the fp8 cache's."""

    bf16: list[SequenceScore]
    fp8: list[SequenceScore]


@dataclass(frozen=True)
class References:
    """Per held-out sequence: the predictions scored, the bf16 and fp8 caches' negative log-likelihoods; and the fp8
    cache against the bf16 cache (its unit scales: the fp8 cache at 1.0)."""

    rows: list[int]
    bf16_nll: list[float]
    fp8_nll: list[float]
    fp8: Accuracy

    def accuracy(self, ours: Scores, unit: Scores, paired: bool) -> Accuracy:
        """`ours` against the bf16 cache, and against `unit` sequence by sequence where `paired` (two caches)."""
        totals = Totals(paired=paired)
        for i, rows in enumerate(self.rows):
            totals.add(rows, self.bf16_nll[i], ours.bf16[i], unit.bf16[i])
        return totals.summary()

    def versus_fp8(self, ours: Scores) -> VersusFp8:
        totals = Totals(paired=False)
        for i, rows in enumerate(self.rows):
            totals.add(rows, self.fp8_nll[i], ours.fp8[i], ours.fp8[i])
        summary = totals.summary()  # its "bf16" perplexity is the reference's: the fp8 cache's
        return VersusFp8(summary.kl_mean, summary.kl_max, summary.top1_agreement, summary.ppl_bf16)


def _cache_label(runs: list[PathRun], cache: PagedModelRunner) -> str:
    """An NVFP4 runner as the timings name it: its write and read, and the paths running it ("at 1.0": a path's
    unit-scale run)."""
    uses = [run.path.name for run in runs if run.cache is cache]
    uses += [f"{run.path.name} at 1.0" for run in runs if run.unit is cache and run.cache is not cache]
    path = next(run.path for run in runs if cache in (run.cache, run.unit))
    return f"{path.cache}, {path.read} read: {'; '.join(uses)}"


def score(bf16: PagedModelRunner, fp8: PagedModelRunner, fp8_unit: PagedModelRunner, runners: list[PagedModelRunner],
          samples: list[list[int]], batch_size: int) -> tuple[References, dict[int, Scores], dict[int, float]]:
    """Prefill every held-out sample once on each runner (`batch_size` at a time), scoring each NVFP4 runner's
    logits against the bf16 and the fp8 cache's as they arrive; keyed by `id(runner)`, with the seconds each runner
    took (prefills and scoring; the three references together under `bf16`'s). As in `measure_accuracy`, a row an
    earlier sample predicts too is scored there alone, and a sample holding nothing new is left out."""
    new = [(ids, repeated) for ids, repeated in zip(samples, repeated_prefixes(samples)) if repeated < len(ids)]
    fp8_totals, rows, bf16_nll, fp8_nll = Totals(), [], [], []
    scores = {id(runner): Scores([], []) for runner in runners}
    seconds = dict.fromkeys([id(bf16), *scores], 0.0)
    for start in range(0, len(new), batch_size):
        clock = time.perf_counter()
        batch, skip = [ids for ids, _ in new[start:start + batch_size]], [n for _, n in new[start:start + batch_size]]
        to_bf16 = [ScoredSample.of(ids[n:], out[n:]) for ids, n, out in zip(batch, skip, prefill(bf16, batch, None))]
        fp8_logits = prefill(fp8, batch, None)
        to_fp8 = [ScoredSample.of(ids[n:], out[n:]) for ids, n, out in zip(batch, skip, fp8_logits)]
        ours = [SequenceScore.of(ids[n:], out[n:], ref) for ids, n, out, ref in zip(batch, skip, fp8_logits, to_bf16)]
        del fp8_logits
        unit = [SequenceScore.of(ids[n:], out[n:], ref)
                for ids, n, out, ref in zip(batch, skip, prefill(fp8_unit, batch, None), to_bf16)]
        for i, (ids, n) in enumerate(zip(batch, skip)):
            fp8_totals.add(len(ids) - n, to_bf16[i].nll, ours[i], unit[i])
            rows.append(len(ids) - n)
            bf16_nll.append(to_bf16[i].nll)
            fp8_nll.append(to_fp8[i].nll)
        seconds[id(bf16)] += time.perf_counter() - clock
        for runner in runners:
            clock = time.perf_counter()
            for ids, n, out, b, f in zip(batch, skip, prefill(runner, batch, None), to_bf16, to_fp8):
                scores[id(runner)].bf16.append(SequenceScore.of(ids[n:], out[n:], b))
                scores[id(runner)].fp8.append(SequenceScore.of(ids[n:], out[n:], f))
            seconds[id(runner)] += time.perf_counter() - clock
    return References(rows, bf16_nll, fp8_nll, fp8_totals.summary()), scores, seconds


def _fp8_scales(scales: KVScales, convention: Nvfp4Convention) -> KVScales:
    """fp8kv's fp8 scales of the observation the stored values came from: amax x headroom / 448, e4m3's."""
    as_448 = converted(scales, convention.name, MODELOPT.name)
    return replace(as_448, kv_dtype=DEFAULT_KV_DTYPE, q=None)


def _per_layer(table: dict[int, tuple[float, ...]]) -> dict[int, float]:
    return {layer: values[0] for layer, values in table.items()}


def _writes(runner: PagedModelRunner) -> Nvfp4Writes:
    cache = runner.cache
    assert isinstance(cache, Nvfp4PagedKVCache)
    counts, held = cache.nvfp4_counts(), runner.counts()
    # the cache's counters per layer and side, summed (it prefilled the held-out text once): the whole cache's
    summed = {f.name: sum(k + v for k, v in getattr(counts, f.name).values()) for f in fields(Nvfp4Counts)}
    return Nvfp4Writes(**summed, values=2 * sum(held.written.values()),  # as many V values as K
                       fp8_k_clamped=sum(k for k, _ in held.clamped.values()))


def path_reasons(judged: tuple[Nvfp4Path, ...], paths: list[Nvfp4PathResult], convention: Nvfp4Convention,
                 folder: Path, thresholds: Thresholds, fp8: Accuracy) -> list[Finding]:
    """Per path: a global scale off from amax / 448 (FAIL where its fp8 read overflows, WARN where the block scales
    sit 6x low) with the fix; an fp8 read past 448, or an fp8 K clamped, at the right scale for more values than the
    saturation bound allows; non-finite logits and the KL bound (FAIL); INFO where it does not load the scales, or is
    no release's. Then its scales against global scale 1.0, every path one family."""
    reasons = []
    by_name = {path.name: path for path in judged}
    for path in paths:
        run, name = by_name[path.path], (path.path,)
        ran = runs_divisor(run, convention)
        fix = fix_command(folder, run)
        # one stored value cannot suit loaders that disagree by 6x: the converted folder is this path's alone
        fixed = (f" Fix: {fix} (it then runs amax / {BOUND:g}; serve that folder on {path.path} alone: the paths that "
                 "keep the stored value run it 6x off)." if fix else " No convention fixes it by convert.")
        figures = _figures(path, fp8)
        if run.cache == FP8_K_NVFP4_V:
            reasons += _fp8_k_reasons(path, figures, thresholds)
        if not run.loads:
            reasons.append(Finding(INFO, f"{path.path} {run.not_loaded}: its NVFP4 cache runs global scale 1.0, "
                                         f"the unit-scale figure ({figures}; {run.known_by})", name))
        elif run.read == "fp8" and ran > BOUND:
            reasons.append(Finding(FAIL, f"{path.path} runs the stored {convention.name} global scale "
                                         f"{_times(run)}= amax / {ran:g}: its e4m3 dequantization overflows wherever "
                                         f"a block's max passes amax x headroom / {ran / BOUND:g}, "
                                         f"{path.writes.fp8_read_over} values past {BOUND:g} on the held-out text "
                                         f"({figures}).{fixed}", name))
        elif ran < BOUND:
            reasons.append(Finding(WARN, f"{path.path} runs the stored {convention.name} global scale "
                                         f"{_times(run)}= amax / {ran:g}, {BOUND / ran:g}x larger than amax / "
                                         f"{BOUND:g}: block scales top out at {ran / E2M1_MAX:.3g} / headroom, not "
                                         f"{BOUND / E2M1_MAX:.3g} / headroom; "
                                         f"{path.writes.subnormal_scales} subnormal and {path.writes.zeroed_blocks} "
                                         f"zeroed on the held-out text ({figures}).{fixed}", name))
        elif run.read == "fp8" and path.writes.fp8_read_over > thresholds.saturation * path.writes.values:
            share = path.writes.fp8_read_over / path.writes.values
            reasons.append(Finding(WARN, f"{path.path}: {share:.3%} of K and V values past {BOUND:g} in its fp8 read "
                                         f"(WARN above {thresholds.saturation:.3%}, the saturation bound): the "
                                         "held-out text passes the calibrated amax x headroom. Fix: recalibrate "
                                         "with a larger --headroom, or on text like this", name))
        if run.loads:
            reasons += _accuracy_reasons(path, thresholds)
    return reasons + unit_scale_reasons(unit_family(paths), thresholds)


def _fp8_k_reasons(path: Nvfp4PathResult, figures: str, thresholds: Thresholds) -> list[Finding]:
    """fp8_k_nvfp4_v's path: INFO that no release read serves it, and a WARN where its fp8 K clamped more values
    than the saturation bound allows (a k_scale 6x too small, amax / 2688, clamps all past amax x headroom / 6)."""
    releases = " and ".join(release.name for release in FP8_K_NVFP4_V_RELEASES)
    found = [Finding(INFO, f"{NO_FP8_K_NVFP4_V_RELEASE}: {releases} run another cache with this folder (fp8kv "
                           f"inspect says which). {path.path}: K written as the fp8 cache here writes it, V as "
                           f"vLLM's nvfp4 write, both read in float32, at the stored scales ({figures})", (path.path,))]
    share = path.writes.fp8_k_clamped / (path.writes.values // 2)
    if share > thresholds.saturation:
        found.append(Finding(WARN, f"{path.path}: {share:.3%} of K values clamped at ±{BOUND:g} in its fp8 K (WARN "
                                   f"above {thresholds.saturation:.3%}, the saturation bound): the held-out K passes "
                                   "the stored k_scale x 448; amax x headroom / 448 keeps it in range, amax / 2688 "
                                   "clamps every value past amax x headroom / 6. Fix: fp8kv calibrate --kv-dtype "
                                   "fp8_k_nvfp4_v, with a larger --headroom or on text like this", (path.path,)))
    return found


def _accuracy_reasons(path: Nvfp4PathResult, thresholds: Thresholds) -> list[Finding]:
    """A FAIL for NaN/inf logits, else for a mean KL to the bf16 cache past the bound, as for an fp8 engine."""
    a = path.accuracy
    if not (math.isfinite(a.kl_mean) and math.isfinite(a.ppl_fp8)):
        return [Finding(FAIL, f"{path.path}: its NVFP4 cache gives NaN/inf logits", (path.path,))]
    if a.kl_mean > thresholds.kl_mean:
        return [Finding(FAIL, f"{path.path}: mean KL of its NVFP4 cache to the bf16 cache {a.kl_mean:.4g} nats exceeds "
                              f"the bound {thresholds.kl_mean:g}", (path.path,))]
    return []


def _times(path: Nvfp4Path) -> str:
    return "as stored " if path.factor == 1.0 else f"x{path.factor:g} "


def _figures(path: Nvfp4PathResult, fp8: Accuracy) -> str:
    a, f = path.accuracy, path.versus_fp8
    return (f"mean KL to bf16 {a.kl_mean:.3g} against the fp8 cache's {fp8.kl_mean:.3g}, to fp8 {f.kl_mean:.3g}; "
            f"perplexity {a.ppl_fp8:.4f}, bf16 {a.ppl_bf16:.4f}, fp8 {f.ppl_fp8:.4f}")
