"""SIGKILL during the write of `fp8kv calibrate` and `fp8kv convert` never leaves a half checkpoint.

Each run starts the real command in a subprocess, waits until the writer's temp folder appears
(the write phase), sleeps a seeded random extra delay and kills it with SIGKILL. Afterwards the
output folder is absent or complete (it passes verify's static checks), the source is unchanged,
and the next run cleans every leftover temp folder.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.tools.factory import make_checkpoint
from fp8kv.verify.static import static_checks
from fp8kv.checks import FAIL
from fp8kv.errors import Fp8kvError

RUNS = 4
MAX_EXTRA_DELAY_S = 0.15


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A checkpoint big enough (~15 MB, 3 shards) that copying it takes a while, and a tiny dataset."""
    root = tmp_path_factory.mktemp("crash")
    src = make_checkpoint("llama", root / "src", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                          max_shard_bytes=6 * 2**20)
    data = root / "data.jsonl"
    data.write_text("".join(f'{{"text": "sample {i} for the crash test"}}\n' for i in range(4)))
    return src, data


def leftovers(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.fp8kv-*"))


def run_to_end(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "fp8kv", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr


def run_and_kill(args: list[str], out: Path, delay: float) -> str:
    """Run `python -m fp8kv ARGS`; SIGKILL it `delay` seconds after its temp folder appears."""
    proc = subprocess.Popen([sys.executable, "-m", "fp8kv", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PJRT_DEVICE": "CPU"})
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(p.name.startswith(f".{out.name}.fp8kv-tmp-{proc.pid}") for p in leftovers(out)):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return "killed" if proc.returncode == -signal.SIGKILL else "finished"
        time.sleep(0.0005)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"fp8kv {args[0]} did not finish in 120 s")
    assert proc.returncode == 0, proc.stderr.read().decode()
    return "finished"


def assert_absent_or_complete(out: Path, provenance: bool) -> None:
    if not out.exists():
        return
    result = static_checks(out)
    failures = [r.message for r in result.reasons if r.level == FAIL]
    assert not failures, failures
    assert result.readout.scales is not None
    assert result.readout.scales.layers == result.readout.source.geometry.kv_layers
    if provenance:
        assert (out / "fp8kv.json").is_file()


def kill_series(args: list[str], out: Path, seed: int, provenance: bool, src: Path) -> list[str]:
    before = SourceCheckpoint.open(src).content_hash()
    rng = random.Random(seed)
    # The first kill lands as soon as the temp folder appears, so at least one hits the write itself
    # however fast the disk; the others land at random moments of it (or just after it).
    delays = [0.0] + [rng.uniform(0.0, MAX_EXTRA_DELAY_S) for _ in range(RUNS - 1)]
    outcomes = []
    for delay in delays:
        outcome = run_and_kill(args, out, delay)
        assert_absent_or_complete(out, provenance)
        outcomes.append("killed mid-write" if outcome == "killed" and leftovers(out) else outcome)
        for path in leftovers(out):  # what a kill leaves sits in a clearly named hidden temp folder
            assert ".fp8kv-tmp-" in path.name or ".fp8kv-old-" in path.name
        assert SourceCheckpoint.open(src).content_hash() == before
    run_to_end(args)  # the next run removes what the killed ones left
    assert_absent_or_complete(out, provenance)
    assert out.is_dir() and not leftovers(out)
    assert SourceCheckpoint.open(src).content_hash() == before
    print(f"fp8kv {args[0]} kill outcomes: {outcomes}")
    return outcomes


def test_sigkill_during_calibrate_write(inputs, tmp_path):
    src, data = inputs
    out = tmp_path / "calibrated"
    args = ["calibrate", str(src), "--dataset", str(data), "--num-samples", "2", "--seq-len", "16",
            "--mode", "copy", "--overwrite", "--json", "--out", str(out)]
    outcomes = kill_series(args, out, seed=9, provenance=True, src=src)
    assert "killed mid-write" in outcomes, outcomes


def test_sigkill_during_convert_write(inputs, tmp_path):
    src, data = inputs
    calibrated = tmp_path / "calibrated"
    run_to_end(["calibrate", str(src), "--dataset", str(data), "--num-samples", "2", "--seq-len", "16",
                "--out", str(calibrated)])
    out = tmp_path / "converted"
    args = ["convert", str(calibrated), "--to", "modelopt", "--mode", "copy", "--overwrite", "--out", str(out)]
    outcomes = kill_series(args, out, seed=19, provenance=True, src=calibrated)
    assert "killed mid-write" in outcomes, outcomes


def test_ctrl_c_during_an_overwrite_says_so_and_leaves_a_whole_output(inputs, tmp_path):
    src, data = inputs
    out = tmp_path / "calibrated"
    args = ["calibrate", str(src), "--dataset", str(data), "--num-samples", "2", "--seq-len", "16",
            "--mode", "copy", "--overwrite", "--out", str(out)]
    run_to_end(args)
    # a process started in the background by a shell without job control ignores SIGINT, and so would this child:
    # give it the default, which Python turns into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "fp8kv", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(f".{out.name}.fp8kv-tmp-{proc.pid}") for p in leftovers(out)):
        assert proc.poll() is None and time.monotonic() < deadline, "the write never started"
        time.sleep(0.0005)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.rstrip().endswith("fp8kv: interrupted; an output is swapped in only once it is complete, so each "
                                    "one is as it was or wholly new"), stderr
    assert_absent_or_complete(out, provenance=True)
    assert out.is_dir() and not leftovers(out)


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_interrupt_between_the_swaps_two_renames_puts_the_old_output_back(tmp_path, monkeypatch):
    from fp8kv.checkpoint import writer

    out, new = tmp_path / "out", tmp_path / "new"
    out.mkdir()
    (out / "old.txt").write_text("old")
    new.mkdir()
    renames = []

    def rename(a, b):
        renames.append((a, b))
        if len(renames) == 2:
            raise KeyboardInterrupt
        os.rename(a, b)

    monkeypatch.setattr(writer.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        writer._swap_in(new, out)
    monkeypatch.undo()
    assert (out / "old.txt").read_text() == "old" and new.is_dir() and not leftovers(out)


def test_an_output_a_killed_run_moved_aside_goes_back_before_anything_else(inputs, tmp_path):
    from fp8kv.checkpoint.writer import check_output

    src, _ = inputs
    out = tmp_path / "out"
    aside = tmp_path / f".out.fp8kv-old-{_gone_pid()}"
    aside.mkdir()
    (aside / "notes.txt").write_text("mine")
    with pytest.raises(Fp8kvError, match="notes.txt"):  # refused as any folder of the user's would be
        check_output(src, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and not aside.exists()
