"""`make demo`'s last step after a verify that did not PASS: say what the verdict is about, and stop the demo unless
it is about engines alone.

A WARN whose every finding names the engines it is about (an engine path on which these scales measure worse than
scale 1.0) is a finding about those engines, which the demo reports and goes on from. A WARN about the scales
themselves (saturation, overlap with the calibration text) or any FAIL stops it with verify's own exit code.

    .venv/bin/python bench/demo_verdict.py out/demo
"""

from __future__ import annotations

import sys
from pathlib import Path

from fp8kv.hub.card import read_report
from fp8kv.verify.verdict import warned_engines


def main() -> int:
    folder = Path(sys.argv[1])
    report = read_report(folder)
    if report is None:
        print(f"{folder}: no verify report; run fp8kv verify {folder}", file=sys.stderr)
        return 2
    alone = warned_engines(report.reasons)
    if alone is None:
        about = "is about the scales themselves" if report.verdict == "WARN" else "stops the demo"
        print(f"make demo: verify's {report.verdict} {about}: see {folder}/verify/report.md", file=sys.stderr)
        return report.exit_code
    print(f"make demo: verify's {report.verdict} is a finding about {', '.join(alone)} alone (its lines above say "
          "what to do there); every other engine judged runs these scales without a finding.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
