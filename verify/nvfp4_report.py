"""How verify's report shows an NVFP4 folder's engine paths (`Nvfp4Check`): report.md's section and the lines
`fp8kv verify` prints; no torch."""

from __future__ import annotations

from collections.abc import Sequence

from fp8kv.console import fmt_number, markdown_table
from fp8kv.options import FP8_K_NVFP4_V
from fp8kv.serving import NO_FP8_K_NVFP4_V_RELEASE
from fp8kv.verify.results import Nvfp4Check, Nvfp4PathResult, PairedDifference
from fp8kv.verify.verdict import Thresholds, UnitComparison, unit_scale_notes


def unit_family(paths: Sequence[Nvfp4PathResult]) -> list[UnitComparison]:
    """Each distinct comparison of a path's scales with global scale 1.0, the family the verdict judges: paths
    sharing a cache share it, one test."""
    named: dict[PairedDifference, list[str]] = {}
    for path in paths:
        kl = next((d for d in path.accuracy.versus_unit if d.measure == "kl_mean"), None)
        if kl is not None:
            named.setdefault(kl, []).append(path.path)
    return [UnitComparison(kl, tuple(names)) for kl, names in named.items()]


def runs(path: Nvfp4PathResult) -> str:
    """The global scale a path runs, as its loader makes it, and the range of its values over K and V."""
    if not path.loads:
        return "1.0 (not loaded)"
    values = path.k_scales + path.v_scales
    how = "as stored" if path.factor == 1.0 else f"x{path.factor:g}"
    return f"{how}: {min(values):.4g} to {max(values):.4g}"


def _kl_vs_unit(path: Nvfp4PathResult) -> str:
    kl = next((d for d in path.accuracy.versus_unit if d.measure == "kl_mean"), None)
    return "-" if kl is None else f"{kl.difference:+.2g} [{kl.low:+.2g}, {kl.high:+.2g}]"


def _past_448(path: Nvfp4PathResult) -> str:
    """The values an fp8 read cannot hold; a float32 read holds them."""
    over = path.writes.fp8_read_over
    return str(over) if path.read == "fp8" or not over else f"{over} (read in float32: held)"


def _clipped(check: Nvfp4Check, path: Nvfp4PathResult) -> str:
    """Values clipped at ±6 block scales, and an fp8 K's values clamped at ±448 where the folder has one."""
    clipped = path.writes.clipped_values
    return f"{clipped} V, {path.writes.fp8_k_clamped} K at ±448" if check.kv_dtype == FP8_K_NVFP4_V else str(clipped)


def _runs(check: Nvfp4Check) -> str:
    """What the paths run, for report.md's section."""
    if check.kv_dtype == FP8_K_NVFP4_V:
        return (f"{NO_FP8_K_NVFP4_V_RELEASE} (the INFO finding says what each runs instead): its one path is fp8kv's "
                "own arithmetic, K in the fp8 e4m3 cache below at the stored k_scale, V as vLLM's nvfp4 write at the "
                "stored v_scale, both read in float32. ")
    return ("Each path runs vLLM's nvfp4 write (or its nvfp4_4over6 write, where the path names it) with the global "
            "scale its release's loader holds (configs/engines.toml, [[nvfp4]]) and its attention's read: fp8 (sm100: "
            "blocks dequantized into e4m3, Q and the output in e4m3), float32 (sm80, sm90, sm120: blocks read in "
            "16 bits, exactly). ")


def nvfp4_section(check: Nvfp4Check, thresholds: Thresholds) -> str:
    """report.md's NVFP4 section: one row per engine path, how each comparison with global scale 1.0 came out where
    the verdict found nothing worse, then the fp8 cache it is compared with."""
    head = ["engine path", "verdict", "read", "global scale run", "block scales saturated / subnormal / zero",
            "values clipped", "fp8-read values past 448", "mean KL to bf16", "top-1 vs bf16", "perplexity",
            "mean KL to fp8", "top-1 vs fp8", "KL vs global scale 1.0 (95 %)"]
    rows = [[p.path, p.verdict, p.read, runs(p),
             f"{p.writes.saturated_scales} / {p.writes.subnormal_scales} / {p.writes.zeroed_blocks}",
             _clipped(check, p), _past_448(p), fmt_number(p.accuracy.kl_mean),
             fmt_number(p.accuracy.top1_agreement, percent=True), fmt_number(p.accuracy.ppl_fp8),
             fmt_number(p.versus_fp8.kl_mean), fmt_number(p.versus_fp8.top1_agreement, percent=True), _kl_vs_unit(p)]
            for p in check.paths]
    fp8 = check.fp8
    return (f"## NVFP4 cache per engine path\n\nThe stored global scales are {check.convention}'s, amax x headroom / "
            f"{check.divisor:g}. " + _runs(check) + "Its scales are compared with the same path at global "
            "scale 1.0, sequence by sequence (sign-flip test, one family with Holm's procedure).\n\n"
            + markdown_table(head, rows) + "".join(f"\n\n- {note}" for note in nvfp4_notes(check, thresholds))
            + f"\n\nThe fp8 e4m3 cache at fp8kv's fp8 scales of the same observation (amax x headroom / 448): "
            f"perplexity {fmt_number(fp8.ppl_fp8)} (bf16 {fmt_number(fp8.ppl_bf16)}), mean KL to bf16 "
            f"{fmt_number(fp8.kl_mean)}, top-1 {fmt_number(fp8.top1_agreement, percent=True)}.")


def nvfp4_notes(check: Nvfp4Check, thresholds: Thresholds) -> list[str]:
    """How each comparison with global scale 1.0 came out where the verdict found nothing worse."""
    return unit_scale_notes(unit_family(check.paths), thresholds)


def nvfp4_lines(check: Nvfp4Check, thresholds: Thresholds) -> list[str]:
    """One line per engine path for the terminal, the fp8 cache's, then the notes on global scale 1.0."""
    lines = [f"nvfp4 {p.path} ({p.verdict}, {p.read} read): global scale {runs(p)}, kl_mean "
             f"{fmt_number(p.accuracy.kl_mean)}, top1 {fmt_number(p.accuracy.top1_agreement, True)}, ppl "
             f"{fmt_number(p.accuracy.ppl_fp8)}; vs fp8 kl_mean {fmt_number(p.versus_fp8.kl_mean)}; fp8-read over "
             f"{p.writes.fp8_read_over}, block scales subnormal {p.writes.subnormal_scales}, clipped {_clipped(check, p)}"
             for p in check.paths]
    return lines + [f"fp8 e4m3 at amax x headroom / 448: kl_mean {fmt_number(check.fp8.kl_mean)}, top1 "
                    f"{fmt_number(check.fp8.top1_agreement, True)}, ppl {fmt_number(check.fp8.ppl_fp8)}"] + [
        f"note: {note}" for note in nvfp4_notes(check, thresholds)]
