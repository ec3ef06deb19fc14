"""Engine models of the fp8 cast, run through the runtime on the held-out text (`fp8kv verify --engine`).

Each engine model (`fp8kv.fp8.ENGINES`) is a runner whose cache writes cast the way that engine
does; "clamp" is verify's fp8 runner itself. Per engine: perplexity, logit rows with a NaN/inf,
sequences with any non-finite logit (lost to the user), and the first layer whose cache holds a
NaN/inf value (later layers inherit it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fp8kv.fp8 import ENGINE_DESCRIPTIONS, ENGINES, check_engine
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.checks import FAIL, Finding
from fp8kv.verify.verdict import headroom_fix

ALL = "all"


def parse_engines(choice: str) -> tuple[str, ...]:
    """`--engine` value: one engine model, or "all" of them."""
    return ENGINES if choice == ALL else (check_engine(choice),)


@dataclass(frozen=True)
class EngineResult:
    """One engine model's run over the held-out samples."""

    engine: str
    ppl: float
    nan_rows: int  # logit rows (one per token) with any NaN/inf
    rows: int
    sequences_lost: int  # samples with any non-finite logit
    sequences: int
    first_nonfinite_layer: int | None  # first KV layer whose cache holds a NaN/inf value

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_nonfinite_layer(runner: PagedModelRunner) -> int | None:
    """The lowest KV layer whose cache was written a NaN/inf value, or None."""
    bad = [layer for layer, pair in runner.counts()["nonfinite"].items() if sum(pair)]
    return min(bad) if bad else None


def engine_reasons(results: list[EngineResult], worst_ratio: float, fp8_max: float) -> list[Finding]:
    """FAIL for each engine model whose logits went non-finite, naming the engine and the fix.

    `worst_ratio` is the largest |x|/scale seen on the held-out text, which sizes the `--headroom` advice.
    """
    reasons = []
    for r in results:
        if r.nan_rows:
            where = f"; first NaN/inf in the cache of layer {r.first_nonfinite_layer}" \
                if r.first_nonfinite_layer is not None else ""
            reasons.append(Finding(FAIL, f"engine {r.engine} ({ENGINE_DESCRIPTIONS[r.engine]}): {r.nan_rows} of {r.rows} "
                                        f"logit rows NaN/inf, {r.sequences_lost} of {r.sequences} sequences lost"
                                        f"{where}. " + headroom_fix(worst_ratio, fp8_max)))
    return reasons
