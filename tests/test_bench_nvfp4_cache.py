"""bench/bench_nvfp4_cache.py: one row per cache and shape, each cache's write and read timed against the fp8 row's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"


def test_each_cache_is_one_row_whose_ratios_are_to_the_fp8_row(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_nvfp4_cache as bench

    rows = bench.bench_shape("smollm2", bench.SEQ_LEN, repeats=1)
    assert [r.cache for r in rows] == list(bench.CACHES)
    fp8 = rows[0]
    assert (fp8.cache, fp8.write_over_fp8, fp8.read_over_fp8, fp8.total_over_fp8) == (bench.FP8, 1.0, 1.0, 1.0)
    for r in rows:
        assert (r.kv_heads, r.head_dim, r.tokens) == (3, 64, bench.SEQ_LEN)
        assert r.write_over_fp8 == r.write_s / fp8.write_s and r.read_over_fp8 == r.read_s / fp8.read_s


def test_help_names_the_options():
    done = subprocess.run([sys.executable, str(BENCH / "bench_nvfp4_cache.py"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(option in done.stdout for option in ("--shapes", "--tokens", "--threads", "--repeats"))
