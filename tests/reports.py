"""verify reports for tests, built by verify's own `build_report`, never typed out by hand."""

from __future__ import annotations

from pathlib import Path

from fp8kv.checkpoint.artifacts import VERIFY_DIR
from fp8kv.checkpoint.provenance import record_written
from fp8kv.checks import Finding
from fp8kv.verify.report import REPORT_JSON, HeldOut, VerifyReport
from fp8kv.verify.run import build_report
from fp8kv.verify.static import static_checks
from fp8kv.verify.verdict import load_thresholds


def report_for(folder: Path, reasons: tuple[Finding, ...] = (), held_out: HeldOut = HeldOut()) -> VerifyReport:
    """The report verify would record for `folder` as it is now, had it found `reasons` and measured
    `held_out` on the CPU."""
    return build_report(static_checks(folder), "cpu", load_thresholds(), list(reasons), held_out, {"total": 0.0})


def write_report(folder: Path, report: VerifyReport) -> Path:
    """`folder/verify/report.json` holding `report`."""
    path = folder / VERIFY_DIR / REPORT_JSON
    path.parent.mkdir(exist_ok=True)
    path.write_text(report.to_json())
    record_written(path)  # as verify records what it writes
    return path
