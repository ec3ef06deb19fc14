"""Engine models run through the runtime on the held-out text (`fp8kv verify --engine`).

Each engine model (`fp8kv.engine_models`) is a runner whose cache writes the bytes that engine writes,
with the scales it runs with. Per engine: perplexity, logit rows with a NaN/inf, sequences with any
non-finite logit (lost to the user), the first layer whose cache holds a NaN/inf value (later layers
inherit it), and the engine source the model reproduces. A released engine that loses a logit row is
a FAIL naming it; a bug model's row shows what that bug would do to this checkpoint.
"""

from __future__ import annotations

from fp8kv.checks import FAIL, INFO, Finding
from fp8kv.engine_models import engine_model
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify.results import EngineResult
from fp8kv.verify.verdict import headroom_fix

PASS, BUG = "PASS", "bug model"


def first_nonfinite_layer(runner: PagedModelRunner) -> int | None:
    """The lowest KV layer whose cache was written a NaN/inf value, or None."""
    bad = [layer for layer, pair in runner.counts().nonfinite.items() if sum(pair)]
    return min(bad) if bad else None


def engine_reasons(results: list[EngineResult], worst_ratio: float, fp8_max: float,
                   headroom: float | None = None) -> list[Finding]:
    """FAIL for each released engine whose logits went non-finite, naming the engine and the fix; INFO for each
    released engine that runs this checkpoint's fp8 cache at scale 1.0, saying why.

    `worst_ratio` is the largest |x|/scale seen on the held-out text, which with `headroom` (the margin the scales
    were made with) sizes the `--headroom` advice.
    """
    reasons = []
    for r in results:
        model = engine_model(r.engine)
        if r.verdict == FAIL:
            where = f"; first NaN/inf in the cache of layer {r.first_nonfinite_layer}" \
                if r.first_nonfinite_layer is not None else ""
            reasons.append(Finding(FAIL, f"engine {r.engine} (past the fp8 maximum it stores {model.above_range}): "
                                        f"{r.nan_rows} of {r.rows} logit rows NaN/inf, {r.sequences_lost} of "
                                        f"{r.sequences} sequences lost{where}. " + headroom_fix(worst_ratio, fp8_max, headroom),
                                   (r.engine,)))
        if model.released and r.unread:
            reasons.append(Finding(INFO, f"engine {r.engine} does not run these scales: {r.unread}. Its fp8 cache "
                                        f"runs at scale 1.0 (perplexity there {r.ppl:.4f}, the unit-scale figure)", (r.engine,)))
    return reasons
