"""What the engine probes share: the engine's own log lines per load, its own error line, and the two ways a probe
answers (one checkpoint for `fp8kv load-check`; a list of loads in one process for the loader matrix).

Standalone like the probes (stdlib only: it runs in the engine's Python, where fp8kv is not installed); a probe
loads it by its path, so the probes' folder never goes on sys.path (it would shadow `import vllm`).

One load: stdout carries one JSON object, and a failure exits 1 with the engine's error line last on stderr.
`--each FILE`: FILE holds one JSON object per line, `{"checkpoint", "kv_cache_dtype", ...}` (the probe's own
options); stdout carries one JSON line per load as it finishes, `{"checkpoint", ...the answer}` or
`{"checkpoint", "error", "warnings"}`, so a caller that sees the process die knows which loads were done.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

# What an engine says about KV scales and the fp8 cache.
_SCALE_LOG = re.compile(r"scal|kv.cache|kv_cache|fp8|MLA", re.IGNORECASE)
# The lines of a wrapped error that say where to read more, never what went wrong (pydantic's last line).
_NOT_A_CAUSE = re.compile(r"^(for further information|https?://)", re.IGNORECASE)


class EngineLog:
    """The engine's log records since the last `take`: its lines about scales and the KV cache, each once, and its
    error lines. A record factory sees every record however the engine reconfigures its handlers."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.lines: list[str] = []
        self.errors: list[str] = []
        make_record = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make_record(*args, **kwargs)
            if record.name.startswith(engine) and record.levelno >= logging.INFO:
                self._keep(record)
            return record

        logging.setLogRecordFactory(factory)

    def _keep(self, record: logging.LogRecord) -> None:
        try:
            message = " ".join(record.getMessage().split())
        except Exception:  # a malformed record must not end the probe
            return
        if record.levelno >= logging.ERROR:
            error = f"{message}: {_last_line(record.exc_info)}" if record.exc_info and record.exc_info[1] else message
            if error not in self.errors:
                self.errors.append(error)
        line = f"{record.levelname}: {message}"
        if _SCALE_LOG.search(message) and line not in self.lines:
            self.lines.append(line)

    def take(self) -> tuple[list[str], list[str]]:
        """The lines and error lines logged since the last call."""
        taken = self.lines, self.errors
        self.lines, self.errors = [], []
        return taken


def _last_line(exc_info: Any) -> str:
    """The last line of a logged exception: the innermost error, even where it came back from a subprocess
    inside the message of the one raised."""
    lines = [line.strip() for line in traceback.format_exception(*exc_info) if line.strip()]
    return " ".join(lines[-1].splitlines()[-1].split()) if lines else ""


def engine_error(exc: BaseException, logged_errors: list[str]) -> str:
    """The engine's own line for why a load failed: the first error it logged, else the innermost exception's first
    line that says something (pydantic wraps a validator's error in a message whose last line is a URL)."""
    if logged_errors:
        return logged_errors[0][:400]
    root = exc
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    errors = getattr(root, "errors", None)
    if callable(errors):  # a pydantic ValidationError: its first error's own message
        try:
            return f"{type(root).__name__}: {' '.join(str(errors()[0]['msg']).split())}"[:400]
        except Exception:  # not pydantic's errors() after all
            pass
    lines = [line.strip() for line in str(root).splitlines() if line.strip() and not _NOT_A_CAUSE.match(line.strip())]
    return f"{type(root).__name__}: {lines[0]}"[:400] if lines else type(root).__name__


def answer(load: Callable[..., dict[str, Any]], log: EngineLog, single: dict[str, Any] | None,
           each: str | None) -> int:
    """Run `load(**options)` for the one load `single`, or for each line of the file `each`, and print the answers
    (see the module's docstring). Only answers go to stdout: everything the engine prints, at the fd level too,
    goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if each is None:
        assert single is not None
        return _answer_one(load, log, single, out)
    with open(each, encoding="utf-8") as handle:
        loads = [json.loads(line) for line in handle if line.strip()]
    for options in loads:
        try:
            result = load(**options)
        except Exception as exc:  # the engine refused this checkpoint: the next one is loaded all the same
            lines, errors = log.take()
            result = {"error": engine_error(exc, errors), "warnings": lines}
        else:
            result["warnings"] = log.take()[0]
        _write(out, {"checkpoint": options["checkpoint"], **result})
    return 0


def _answer_one(load: Callable[..., dict[str, Any]], log: EngineLog, options: dict[str, Any], out: TextIO) -> int:
    try:
        result = load(**options)
    except ModuleNotFoundError as exc:
        print(f"no module named {exc.name}", file=sys.stderr)
        return 1
    except Exception as exc:  # one line for fp8kv to show; the engine's log above it has the detail
        print(engine_error(exc, log.take()[1]), file=sys.stderr)
        return 1
    result["warnings"] = log.take()[0]
    _write(out, result)
    return 0


def _write(out: TextIO, result: dict[str, Any]) -> None:
    out.write(json.dumps(result) + "\n")
    out.flush()


def exit_now(code: int) -> None:
    """Exit without the engine's exit handlers: a half-started engine has nothing to shut down, and they can hang
    on the threads and process groups it leaves."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
