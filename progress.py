"""Progress of calibrate and verify on stderr: the one helper both commands use.

In a terminal every stage is a rich bar with counts, elapsed time and ETA. Anywhere else (CI,
Slurm, `| tee`) it prints plain timestamped lines: one when a stage starts and one every
`PLAIN_INTERVAL_S` while it runs. `quiet` hides progress but never notes: a note changes what
the results mean (a fallback dataset, fewer samples than asked).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable, TextIO

PLAIN_INTERVAL_S = 10.0


def quiet_libraries() -> None:
    """Keep third-party notes off stderr (transformers' load report, datasets' and lm_eval's notices):
    fp8kv says what matters itself; `fp8kv -v` leaves them on. Call before those libraries load."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


class StageProgress:
    """`progress(stage, done, total)` reports a stage (a new name starts it); `progress.note(text)` tells the user."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None, interval_s: float = PLAIN_INTERVAL_S):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self._stage: str | None = None
        self._started = self._printed = 0.0
        self._bar = None
        self._task = None

    def __enter__(self) -> StageProgress:
        _silence_library_progress()
        if not self.quiet and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn, MofNCompleteColumn, Progress as Bars, SpinnerColumn, TextColumn, TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
            self._bar = Bars(*columns, console=Console(file=self.stream), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def __call__(self, stage: str, done: int = 0, total: int | None = None) -> None:
        now = time.monotonic()
        new = stage != self._stage
        if new:
            self._stage, self._started, self._printed = stage, now, now
        if self.quiet:
            return
        if self._bar is not None:
            if new:
                if self._task is not None:  # a finished stage stays visible, its clock stopped
                    self._bar.stop_task(self._task)
                self._task = self._bar.add_task(stage, total=total)
            self._bar.update(self._task, completed=done, total=total)
        elif new:
            self._line(f"{stage}" + (f": {done}/{total}" if total else ""))
        elif now - self._printed >= self.interval_s or (total and done == total):
            self._printed = now
            self._line(f"{stage}: {done}/{total}{_eta(now - self._started, done, total)}")

    def stage(self, stage: str) -> Callable[[int, int], None]:
        """A (done, total) callback for one stage, for loops that only count."""
        return lambda done, total: self(stage, done, total)

    def note(self, message: str) -> None:
        """One line the user must see (printed even when quiet, above any bar)."""
        if self._bar is not None:
            self._bar.console.print(f"fp8kv: {message}", highlight=False, markup=False)
        else:
            print(f"fp8kv: {message}", file=self.stream, flush=True)

    def _line(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} fp8kv: {text}", file=self.stream, flush=True)


def announce(progress: StageProgress | None, stage: str) -> None:
    """`progress(stage)`: a timestamped line naming the stage, or nothing without progress."""
    if progress is not None:
        progress(stage)


def stage_callback(progress: StageProgress | None, stage: str) -> Callable[[int, int], None] | None:
    """`progress.stage(stage)`, or None without progress."""
    return None if progress is None else progress.stage(stage)


def _eta(elapsed: float, done: int, total: int | None) -> str:
    if not total or done <= 0 or done >= total:
        return f" ({elapsed:.0f} s)"
    return f" ({elapsed:.0f} s, ETA {elapsed / done * (total - done):.0f} s)"


def _silence_library_progress() -> None:
    """datasets', transformers' and huggingface_hub's own bars would interleave with ours.

    Set through their environment variables, so that a command refused in its first second never
    imports them; a library already imported is told directly.
    """
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        logging = sys.modules["transformers"].utils.logging
        logging.disable_progress_bar()
        logging.set_verbosity_error()
