"""verify reports for tests, built from `VerifyReport` as verify builds them, never typed out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8kv.checkpoint.provenance import record_written
from fp8kv.checkpoint.digest import checkpoint_digest
from fp8kv.checks import Finding
from fp8kv.verify.report import REPORT_JSON, VerifyReport
from fp8kv.verify.static import static_checks
from fp8kv.verify.verdict import EXIT_CODES, load_thresholds


def report_for(folder: Path, verdict: str = "PASS", reasons: tuple[Finding, ...] = (), **fields: Any) -> VerifyReport:
    """The report verify would record for `folder` as it is now: its static part, `verdict`, and `fields`
    (held-out sections) when given."""
    static = static_checks(folder)
    readout = static.readout
    return VerifyReport(
        checkpoint=str(folder), digest=checkpoint_digest(folder), device="cpu", convention=static.convention,
        kv_dtype=readout.kv_dtype, thresholds=load_thresholds().as_dict(), static=static.summary(),
        scales=readout.scales.rows() if readout.scales else [], verdict=verdict, exit_code=EXIT_CODES[verdict],
        timings_s={"total": 0.0}, reasons=reasons, **fields,
    )


def write_report(folder: Path, report: VerifyReport) -> Path:
    """`folder/verify/report.json` holding `report`."""
    path = folder / "verify" / REPORT_JSON
    path.parent.mkdir(exist_ok=True)
    path.write_text(report.to_json())
    record_written(path)  # as verify records what it writes
    return path
