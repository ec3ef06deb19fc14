"""The verify report: the `VerifyReport` type with its JSON round trip (report.json, read by the card
and push), report.md, and scales.png.

Each file is written under a temporary name in the report folder, then renamed into place.
Non-finite numbers (NaN perplexity of a broken cache) become null in JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from fp8kv.checkpoint.digest import CheckpointDigest
from fp8kv.checkpoint.artifacts import write_file_atomic
from fp8kv.checkpoint.provenance import record_written
from fp8kv.checks import Finding
from fp8kv.errors import Fp8kvError
from fp8kv.console import fmt_number, layer_table, markdown_table, plain_table
from fp8kv.inspection import ScaleRow
from fp8kv.kvdtypes import FP8_MAX, RAW_CAST_FINITE_LIMIT
from fp8kv.json_fields import dataclass_from_json, from_json_value, to_json_value
from fp8kv.options import DEFAULT_KV_DTYPE
from fp8kv.runtime.xla_cost import RuntimeSummary
from fp8kv.verify.results import (
    Accuracy, EngineResult, Fidelity, GenerationDetails, GenerationMatch, LayerCheck, Nvfp4Check, PairedDifference,
    QueryCost, Readback, StaticSummary,
)
from fp8kv.verify.nvfp4_report import nvfp4_lines, nvfp4_section
from fp8kv.verify.verdict import Thresholds, engine_unit_scale_notes, warned_engines

REPORT_JSON, REPORT_MD, PLOT = "report.json", "report.md", "scales.png"
# (label, key, is a share) of the accuracy rows.
_ACCURACY = [("Perplexity, bf16 cache", "ppl_bf16", False), ("Perplexity, fp8 + these scales", "ppl_fp8", False),
             ("Perplexity, fp8 + unit scales", "ppl_fp8_unit", False), ("Mean KL to bf16", "kl_mean", False),
             ("Max KL to bf16", "kl_max", False), ("Top-1 agreement", "top1_agreement", True),
             ("Mean KL to bf16, unit scales", "kl_mean_unit", False),
             ("Top-1 agreement, unit scales", "top1_agreement_unit", True)]


@dataclass(frozen=True)
class HeldOut:
    """What the held-out checks measured; a section keeps its default when its check did not run."""

    text_source: str | None = None
    num_samples: int = 0
    num_tokens: int = 0
    num_repeated: int = 0  # tokens whose prediction an earlier sample makes too (its first tokens): scored there alone
    accuracy: Accuracy | None = None
    generation: GenerationMatch | None = None
    readback: Readback | None = None
    layers: tuple[LayerCheck, ...] = ()
    runtime: RuntimeSummary | None = None
    engines: tuple[EngineResult, ...] = ()
    query: QueryCost | None = None  # --quantize-query on a checkpoint with q_scale
    generation_details: GenerationDetails | None = None
    fidelity: Fidelity | None = None
    nvfp4: Nvfp4Check | None = None  # an NVFP4 folder: its cache per engine path


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Everything one verify run found. report.json holds its fields in this order, the held-out sections
    at the top level in `held_out`'s place."""

    checkpoint: str
    digest: CheckpointDigest  # exactly what was judged: card and push refuse the report once the folder differs
    device: str
    convention: str | None
    kv_dtype: str | None
    thresholds: Thresholds
    static: StaticSummary
    scales: tuple[ScaleRow, ...]
    held_out: HeldOut = HeldOut()
    verdict: str
    exit_code: int
    timings_s: dict[str, float]  # phase -> seconds, the phases that ran
    reasons: tuple[Finding, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (NaN/inf as null); the optional sections are left out when absent."""
        out: dict[str, Any] = {}
        for name in (f.name for f in fields(self)):
            if name == "held_out":
                out.update((key, value) for key, value in to_json_value(self.held_out).items()
                           if value is not None or key not in _OPTIONAL_SECTIONS)
            else:
                out[name] = self.digest.to_json() if name == "digest" else to_json_value(getattr(self, name))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str | Path = REPORT_JSON) -> VerifyReport:
        """Parse what `to_json` wrote; one `Fp8kvError` naming `where` for anything else."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise Fp8kvError(f"{where}: cannot be read as JSON ({exc})") from None
        digest = CheckpointDigest.from_json(data.get("digest") if isinstance(data, dict) else None, str(where))
        hints = get_type_hints(cls)
        try:
            values = {f.name: from_json_value(hints[f.name], data[f.name], repr(f.name)) for f in fields(cls)
                      if f.name not in ("digest", "held_out")}
            held_out = dataclass_from_json(HeldOut, data, "the report")
        except (KeyError, TypeError) as exc:
            detail = f"missing {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
            raise Fp8kvError(f"{where}: not an fp8kv verify report ({detail}); run `fp8kv verify` again") from None
        return cls(digest=digest, held_out=held_out, **values)


_OPTIONAL_SECTIONS = ("query", "generation_details", "fidelity", "nvfp4")


def write_report(report: VerifyReport, out_dir: Path) -> None:
    """Write report.json, report.md and, with the `plot` extra, scales.png into `out_dir` (created if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = report.to_json()
    clean = VerifyReport.from_json(text, out_dir / REPORT_JSON)  # what a reader of report.json sees: NaN as None
    write_file_atomic(out_dir / REPORT_JSON, text.encode())
    write_file_atomic(out_dir / REPORT_MD, render_markdown(clean).encode())
    png = plot_png(clean)
    if png is None:  # a plot of an earlier run would show other numbers than this report
        (out_dir / PLOT).unlink(missing_ok=True)
        record_written(out_dir / REPORT_JSON, out_dir / REPORT_MD)
        return
    write_file_atomic(out_dir / PLOT, png)
    record_written(out_dir / REPORT_JSON, out_dir / REPORT_MD, out_dir / PLOT)


def render_markdown(report: VerifyReport) -> str:
    """A human-readable report: verdict and reasons, setup, accuracy, generation, per-layer table."""
    parts = [f"# fp8kv verify: {report.verdict}", f"Checkpoint: `{report.checkpoint}`"]
    if report.reasons:
        parts.append("\n".join(f"- **{r.level}**: {r.message}" for r in report.reasons))
    held = report.held_out
    setup = [("Device", report.device), ("Convention", report.convention), ("KV dtype", report.kv_dtype),
             ("Held-out text", held.text_source), ("Samples", held.num_samples), ("Tokens", held.num_tokens),
             ("Of them, predictions an earlier sample makes too (scored once)", held.num_repeated)]
    if held.readback:
        setup.append(("Runtime scales equal the file's (float32 bits)", "yes" if held.readback.equal else "NO"))
    fid = held.fidelity
    if fid:
        setup.append(("bf16 runtime vs transformers: mean KL (bound)",
                      f"{fmt_number(fid.kl_mean)} ({fmt_number(fid.bound)})"))
    parts.append(markdown_table(["Setting", "Value"], [[k, fmt_number(v)] for k, v in setup]))
    if held.accuracy:
        rows = [[label, fmt_number(getattr(held.accuracy, key), share)] for label, key, share in _ACCURACY]
        parts.append("## Accuracy of fp8kv's runtime\n\nIts write divides in float32 and clamps, the arithmetic the "
                     "engines below are compared with; each engine's own figures, which the verdict judges, are in "
                     "its row.\n\n" + markdown_table(["Metric", "Value"], rows))
    if held.nvfp4:
        parts.append(nvfp4_section(held.nvfp4, report.thresholds))
    compared = _engines_by_comparison(held.engines)
    if compared:
        parts.append("## These scales against unit scales, per engine\n\nEach measure compared sequence by sequence "
                     "over the held-out text, on the engine's own write at both scales; the interval and p-value are "
                     "a sign-flip test over sequences (95 %). Mean KL decides; top-1 and perplexity are notes.\n\n"
                     + "\n\n".join(f"{', '.join(names)}:\n\n{versus_unit_table(accuracy)}"
                                    for accuracy, names in compared))
    if held.query:
        parts.append("## Query quantized with q_scale (fp8 attention)\n\n"
                     + markdown_table(["Metric", "Value"], _field_rows(held.query)))
    if held.generation:
        rows = [[phase, fmt_number(getattr(held.generation, f"{phase}_match"), percent=True)]
                for phase in ("prefill", "decode", "prefix")]
        parts.append("## Greedy tokens matching the bf16 cache\n\n" + markdown_table(["Phase", "Match"], rows))
    if held.engines:
        parts.append("## Engine models, run on the held-out text\n\n" + engine_table(held.engines)
                     + "\n\nEach row writes the cache the way that engine's released code does (source below; "
                     "docs/engines.md). A released engine with any NaN/inf logit row is a FAIL; a bug model's row "
                     "shows what that bug would do to this checkpoint.\n\n" + engine_sources(held.engines))
    if held.runtime:
        parts.append("## Runtime\n\n" + markdown_table(["Setting", "Value"], _field_rows(held.runtime)))
    if held.layers:
        parts.append("## Per layer\n\n" + _layer_table(report) + "\n\nSaturation: exact share of values the fp8 "
                     "cache clamped at ±MAX. Max |x|/scale: from K/V the bf16 cache stored on the same text.")
    parts.append("## Thresholds\n\n" + markdown_table(["Threshold", "Value"], _field_rows(report.thresholds, spaced=False)))
    return "\n\n".join(parts) + "\n"


def _field_rows(section: Any, spaced: bool = True) -> list[list[str]]:
    """One row per field of a result type: its name (`spaced`: with spaces for underscores) and its value through
    `fmt_number`; a mapping or nested type (calls per attention function, compiles) as `name value` pairs."""
    def shown(value: Any) -> str:
        if is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        if isinstance(value, dict):
            return ", ".join(f"{key} {fmt_number(item)}" for key, item in value.items()) or "-"
        return fmt_number(value)

    return [[f.name.replace("_", " ") if spaced else f.name, shown(getattr(section, f.name))] for f in fields(section)]


def _layer_table(report: VerifyReport) -> str:
    """The file's scales next to what each cache layer did on the held-out text."""
    scales = {row.layer: asdict(row) for row in report.scales}
    return markdown_table(*layer_table([{**scales.get(row.layer, {}), **asdict(row)} for row in report.held_out.layers]))


def _engines_by_comparison(engines: tuple[EngineResult, ...]) -> list[tuple[Accuracy, list[str]]]:
    """The released engines that compared these scales with unit scales, those with the same comparison as one."""
    grouped: dict[tuple[PairedDifference, ...], tuple[Accuracy, list[str]]] = {}
    for e in engines:
        if e.accuracy and e.accuracy.versus_unit and e.known_by and not e.unread:
            grouped.setdefault(e.accuracy.versus_unit, (e.accuracy, []))[1].append(e.engine)
    return list(grouped.values())


def versus_unit_table(accuracy: Accuracy) -> str:
    """One row per paired measure: these scales, unit scales, the difference, its interval and the p-value that
    these scales do worse."""
    def shown(measure: str, value: float) -> str:
        return f"{value:.2%}" if measure == "top1_agreement" else f"{value:.4g}"

    rows = [[d.measure, shown(d.measure, d.ours), shown(d.measure, d.theirs), shown(d.measure, d.difference),
             f"[{shown(d.measure, d.low)}, {shown(d.measure, d.high)}]", f"{d.p_worse:.2g}", str(d.tokens)]
            for d in accuracy.versus_unit]
    return markdown_table(["measure (nll: log-perplexity)", "these scales", "unit scales", "difference",
                           "95 % interval", "p (worse)", "tokens"], rows)


def engine_sources(engines: tuple[EngineResult, ...]) -> str:
    """One list item per engine model: the engine, version and file it reproduces, and what selects a hardware path."""
    return "\n".join(f"- {e.engine}: {e.source}" + (f"; this path is taken for {e.selected_by}" if e.selected_by else "")
                     + (f" ({e.known_by})" if e.known_by else "") for e in engines)


def engine_table(engines: tuple[EngineResult, ...]) -> str:
    """One row per engine model: its verdict, the scales it runs, perplexity, mean KL and top-1 agreement against the
    bf16 cache, these scales' mean KL against its own write at unit scales (difference and 95 % interval), NaN/inf
    rows, sequences lost, where NaN first showed, and its attention."""
    head = ["engine", "verdict", "scales it runs", "perplexity", "mean KL", "top-1", "KL vs unit scales (95 %)",
            "NaN/inf logit rows", "sequences lost", "first non-finite layer", "attention"]
    rows = [[e.engine, e.verdict, "1.0 (not read)" if e.unread else "the checkpoint's", fmt_number(e.ppl),
             fmt_number(e.accuracy.kl_mean if e.accuracy else None),
             fmt_number(e.accuracy.top1_agreement if e.accuracy else None, percent=True), _versus_unit_cell(e),
             f"{e.nan_rows} of {e.rows}", f"{e.sequences_lost} of {e.sequences}", fmt_number(e.first_nonfinite_layer),
             e.attention] for e in engines]
    return markdown_table(head, rows)


def _versus_unit_cell(engine: EngineResult) -> str:
    kl = next((d for d in engine.accuracy.versus_unit if d.measure == "kl_mean"), None) if engine.accuracy else None
    if kl is None:
        return "-"
    return f"{kl.difference:+.2g} [{kl.low:+.2g}, {kl.high:+.2g}]"


def plot_png(report: VerifyReport) -> bytes | None:
    """PNG bytes: the reason for the verdict at a glance; None without matplotlib (`pip install "fp8kv[plot]"`), and
    for an NVFP4 report (its figures are each engine path's, in report.md's table).

    Top: per layer, the largest |x|/scale of K and V on the held-out text against the fp8 maximum
    (clamped above it) and the raw-cast limit (NaN/inf above it without a clamp). Bottom: the share
    of K and V values clamped, in %, against the WARN bound.
    """
    import io

    if report.held_out.nvfp4:
        return None
    # matplotlib caches its font list in ~/.cache; keep it in the temp dir (fp8kv writes nowhere else).
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "fp8kv-matplotlib"))
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    rows = report.held_out.layers
    layers = [row.layer for row in rows]
    kv_dtype = report.kv_dtype or DEFAULT_KV_DTYPE
    fp8_max, raw_limit = FP8_MAX[kv_dtype], RAW_CAST_FINITE_LIMIT[kv_dtype]
    for kind, marker in (("k", "o"), ("v", "s")):
        top.plot(layers, [getattr(row, f"{kind}_max_ratio") for row in rows], marker=marker, linestyle="none",
                 label=f"{kind.upper()} max |x|/scale")
    top.axhline(fp8_max, color="orange", linestyle="--", linewidth=1, label=f"fp8 max {fp8_max:g}: clamped above")
    top.axhline(raw_limit, color="red", linewidth=1, label=f"{raw_limit:g}: NaN/inf above without a clamp")
    top.set_ylabel("max |x| / scale (held-out)")
    top.set_title(f"fp8kv verify: {report.verdict}" + ("" if rows else " (no held-out statistics)"))
    top.legend(fontsize="small")
    width, bound = 0.4, 100 * report.thresholds.saturation
    highest = 3 * bound
    for offset, kind in ((-width / 2, "k"), (width / 2, "v")):
        shares = [100 * getattr(row, f"{kind}_saturation") for row in rows]
        highest = max([highest, *shares])
        bottom.bar([layer + offset for layer in layers], shares, width=width, label=f"{kind.upper()} clamped")
    bottom.axhline(bound, color="red", linestyle="--", linewidth=1, label=f"WARN above {bound:g} %")
    bottom.set_ylim(0, highest * 1.15)
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylabel("values clamped at ±max (%)")
    bottom.set_xlabel("layer")
    bottom.legend(fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def held_out_table(held: HeldOut) -> str:
    """The held-out text per cache and engine: perplexity, mean KL and top-1 agreement against the bf16 cache, and
    the sequences whose logits went NaN or inf."""
    head = ["cache and scales", "engine", "verdict", "held-out PPL", "KL vs bf16", "top-1", "sequences lost"]
    rows = []
    accuracy = held.accuracy
    if accuracy:
        rows += [["bf16", "-", "", fmt_number(accuracy.ppl_bf16), "0", "100 %", "-"],
                 ["fp8, unit scales", "fp8kv", "", fmt_number(accuracy.ppl_fp8_unit), fmt_number(accuracy.kl_mean_unit),
                  fmt_number(accuracy.top1_agreement_unit, True), "-"],
                 ["fp8, these scales", "fp8kv", "", fmt_number(accuracy.ppl_fp8), fmt_number(accuracy.kl_mean),
                  fmt_number(accuracy.top1_agreement, True), "-"]]
    rows += [["fp8, 1.0 (not read)" if e.unread else "fp8, these scales", e.engine, e.verdict, fmt_number(e.ppl),
              fmt_number(e.accuracy.kl_mean if e.accuracy else None),
              fmt_number(e.accuracy.top1_agreement if e.accuracy else None, True),
              f"{e.sequences_lost} of {e.sequences}"] for e in held.engines]
    return plain_table(head, rows)


def show(result: Any, json_output: bool = False) -> None:
    """Print the report as JSON on stdout, or the verdict, reasons and key numbers as text."""
    report: VerifyReport = result.report
    if json_output:
        print(report.to_json(), end="")
        return
    print(f"fp8kv verify: {result.verdict}  ({report.checkpoint}, {report.device})")
    for reason in report.reasons:
        print(f"  {reason.level}: {reason.message}")
    held = report.held_out
    if held.accuracy or held.engines:
        print("\n".join("  " + line for line in held_out_table(held).splitlines()))
    for line in nvfp4_lines(held.nvfp4, report.thresholds) if held.nvfp4 else []:
        print(f"  {line}")
    for note in engine_unit_scale_notes(held.engines, report.thresholds):
        print(f"  note: {note}")
    alone = warned_engines(report.reasons)
    if alone:
        print(f"  the WARN is about {', '.join(alone)} alone: every other engine judged runs these scales without a "
              "finding")
    query = held.query
    if query:
        print(f"  with Q quantized by q_scale: kl_mean {fmt_number(query.kl_mean)} "
              f"(K/V only {fmt_number(query.kl_mean_kv_only)}), top1 {fmt_number(query.top1_agreement, True)}")
    print(f"  report: {result.report_dir / REPORT_MD}")
