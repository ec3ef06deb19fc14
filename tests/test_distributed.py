"""Calibration across processes: torchrun ranks give exactly the scales of one process; rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from fp8kv.calibrate import distributed
from fp8kv.observe import NUM_BINS, KVStatistics


def calibrate_args(model: Path, corpus: str, out: Path) -> list[str]:
    # batch size 2 over 6 samples: 3 batches, so the two ranks get unequal shares (2 and 1)
    return ["calibrate", str(model), "--dataset", corpus, "--num-samples", "6", "--seq-len", "60",
            "--batch-size", "2", "--device", "cpu", "--out", str(out), "--json"]


def test_two_ranks_give_the_scales_of_one_process(corpus, tmp_path):
    """torchrun, 2 CPU ranks, layer by layer on gemma2 (sliding + full layers) against one whole-model process."""
    from fp8kv.data import DataRequest
    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    from fp8kv.tools.factory import make_checkpoint

    model = make_checkpoint("gemma2", tmp_path / "gemma2", num_layers=3)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fp8kv", *calibrate_args(model, corpus, tmp_path / "two"), "--layerwise"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert two.returncode == 0, two.stderr
    summary = json.loads(two.stdout)  # rank 0 alone prints, and gloo's chatter stays off stdout
    assert summary["out"] == str(tmp_path / "two")
    one = calibrate(CalibrationRequest(
        model=str(model), data=DataRequest(dataset=corpus, num_samples=6, seq_len=60), batch_size=2,
        device="cpu", layerwise=False, out=tmp_path / "one",
    ))
    written = [json.loads((tmp_path / name / "fp8kv.json").read_text()) for name in ("one", "two")]
    assert written[0]["layers"] == written[1]["layers"] == summary["layers"] == one.provenance.to_dict()["layers"]
    assert written[0]["dataset"]["num_tokens"] == written[1]["dataset"]["num_tokens"]
    assert all(row["k_amax"] > 0 and row["v_amax"] > 0 for row in written[1]["layers"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma2", "one", "two"]  # no spill or temp left behind


def test_shard_batches_follows_torchrun_environment(monkeypatch):
    batches = list(range(7))
    assert distributed.shard_batches(batches) == batches
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    assert distributed.shard_batches(batches) == [1, 4]
    assert not distributed.is_writer()
    monkeypatch.setenv("RANK", "0")
    assert distributed.shard_batches(batches) == [0, 3, 6]
    assert distributed.is_writer()


def _reduce_worker(rank: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    stats = KVStatistics.empty(2, 2)
    stats.amax[0] = torch.tensor([[1.0, 5.0], [2.0, 0.5]]) * (rank + 1)  # rank 1 larger everywhere in layer 0
    stats.amax[1, 0, 0] = float("nan") if rank == 1 else 3.0  # NaN on one rank must survive the MAX
    stats.amax[1, 1] = torch.tensor([4.0, 1.0]) if rank == 0 else torch.tensor([1.0, 4.0])
    stats.hist[0, 0, 0, 7] = 10 + rank
    stats.tokens += 5 * (rank + 1)
    reduced = distributed.reduce_statistics(stats, torch.device("cpu"))
    save_file({"amax": reduced.amax, "hist": reduced.hist, "tokens": reduced.tokens}, f"{results}.{rank}")
    dist.destroy_process_group()


def test_reduction_is_max_of_amax_and_sum_of_counts(tmp_path):
    results = str(tmp_path / "reduced")
    mp.spawn(_reduce_worker, args=(str(tmp_path / "init"), results), nprocs=2, join=True)
    for rank in (0, 1):
        got = load_file(f"{results}.{rank}")
        assert torch.equal(got["amax"][0], torch.tensor([[2.0, 10.0], [4.0, 1.0]]))
        assert torch.isnan(got["amax"][1, 0, 0]) and got["amax"][1, 0, 1] == 0
        assert torch.equal(got["amax"][1, 1], torch.tensor([4.0, 4.0]))
        assert got["hist"][0, 0, 0, 7] == 21 and got["hist"].sum() == 21 and got["hist"].shape[-1] == NUM_BINS
        assert torch.equal(got["tokens"], torch.tensor([15, 15]))


def test_single_process_reduction_is_identity():
    stats = KVStatistics.empty(1, 2)
    stats.amax += 2.5
    assert torch.equal(distributed.reduce_statistics(stats, torch.device("cpu")).amax, stats.amax)
