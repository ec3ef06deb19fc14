"""What the headroom study and the demo table share: calibration statistics, scales, and fp8 runs against bf16.

A run prefills held-out samples on fp8kv's paged runtime with one cache (bf16, or fp8 with given
scales and a write engine) and keeps float32 logits per sample; `compare` scores them against the
bf16 cache's logits: perplexity, mean KL(bf16 || fp8) of the next-token distributions, top-1
agreement, and sequences lost (any NaN/inf logit in the sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8kv.data import CalibrationData, DataRequest, load_calibration_data, repeated_prefixes
from fp8kv.observe import KVStatistics
from fp8kv.calibrate.pipeline import CalibrationRequest, observe_whole_model
from fp8kv.data import load_tokenizer
from fp8kv.calibrate.scales import ScaleTable, compute_scales
from fp8kv.options import Strategy
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.runtime.runner import PagedModelRunner, load_model
from fp8kv.verify import heldout
from fp8kv.verify.accuracy import NextTokenLoss, runtime_scales, token_kl

BATCH = 8  # sequences per prefill step


@dataclass
class Model:
    """A checkpoint, its tokenizer, and one copy of its weights on the CPU shared by every runner."""

    source: SourceCheckpoint
    tokenizer: Any
    weights: torch.nn.Module

    @classmethod
    def open(cls, path: Path) -> Model:
        source = SourceCheckpoint.open(path)
        return cls(source, load_tokenizer(source.path, False), load_model(source.path, torch.device("cpu")))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return self.source.geometry.kv_layers

    def data(self, path: Path, num_samples: int, seq_len: int) -> CalibrationData:
        return load_calibration_data(DataRequest(str(path), num_samples=num_samples, seq_len=seq_len), self.tokenizer)

    def observe(self, data: CalibrationData, batch_size: int = 8,
                last_batch: KVStatistics | None = None) -> KVStatistics:
        """K/V statistics over `data`, exactly as `fp8kv calibrate` folds them."""
        request = CalibrationRequest(model=str(self.source.path), batch_size=batch_size, device="cpu")
        s = self.source
        return observe_whole_model(s, data, request, self.tokenizer, last_batch=last_batch)

    def scales(self, statistics: KVStatistics, headroom: float, strategy: str = "amax",
               last_batch: KVStatistics | None = None) -> tuple[ScaleTable, KVScales]:
        table = compute_scales(statistics, self.kv_layers, strategy=Strategy.parse(strategy), headroom=headroom,
                               last_batch=last_batch)
        return table, KVScales.from_tensors(k=table.tensors(0), v=table.tensors(1))

    def common(self, longest: int) -> dict[str, Any]:
        """What every runner of this model shares: the CPU, the one copy of the weights, room for `longest` tokens."""
        return dict(device="cpu", max_model_len=longest, max_num_seqs=BATCH, model=self.weights)

    def run(self, samples: list[list[int]], scales: KVScales | None, engine: str = "vllm-tpu") -> Run:
        """Prefill `samples` on a bf16 cache (`scales=None`) or an fp8 cache with `scales` and `engine`."""
        common = self.common(max(len(s) for s in samples))
        if scales is None:
            runner = PagedModelRunner(self.source.path, cache_dtype="bf16", **common)
        else:
            k, v = runtime_scales(scales, self.kv_layers)
            runner = PagedModelRunner(self.source.path, cache_dtype=scales.kv_dtype, k_scales=k, v_scales=v,
                                      engine=engine, **common)
        return run_on(runner, samples)


def run_on(runner: PagedModelRunner, samples: list[list[int]]) -> Run:
    """Prefill `samples` on `runner`, `BATCH` at a time."""
    logits = []
    for start in range(0, len(samples), BATCH):
        batch = samples[start : start + BATCH]
        seqs = [runner.start()[0] for _ in batch]
        logits += runner.step(list(zip(seqs, batch)))
        for seq in seqs:
            runner.free(seq)
    return Run(logits, int(runner.cache.nonfinite.sum()))


def max_ratio(model: Model, held: KVStatistics, scales: KVScales) -> float:
    """The largest held-out |x|/scale of any layer under `scales`."""
    amax = {layer: (held.amax[layer, 0].tolist(), held.amax[layer, 1].tolist()) for layer in model.kv_layers}
    return max(max(r.k_max_ratio, r.v_max_ratio) for r in heldout.max_ratio_rows(amax, scales, model.kv_layers))


@dataclass
class Run:
    """Float32 logits [len(sample), vocab] per sample, and NaN/inf values the cache stored."""

    logits: list[torch.Tensor]
    nonfinite_stored: int


@dataclass(frozen=True)
class Scores:
    """One run scored against the bf16 run; `kl_per_sample` lets two runs be compared pairwise."""

    ppl: float
    kl_mean: float
    top1: float
    sequences_lost: int
    kl_per_sample: tuple[float, ...]


def compare(samples: list[list[int]], run: Run, reference: Run) -> Scores:
    """Perplexity of `run`, and its KL / top-1 against `reference`, each prediction once as verify counts it (a
    sample's rows after a prefix an earlier sample began with); a sample that is all such a prefix is left out."""
    loss, kl_sum, agree, tokens, lost, per_sample = NextTokenLoss(), 0.0, 0, 0, 0, []
    for ids, logits, ref_logits, repeated in zip(samples, run.logits, reference.logits, repeated_prefixes(samples)):
        if repeated == len(ids):
            continue
        ids, logits, ref_logits = ids[repeated:], logits[repeated:], ref_logits[repeated:]
        logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
        lost += int(not bool(torch.isfinite(logits).all()))
        loss.add(ids, logp)
        kl = float(token_kl(ref, logp).sum())
        kl_sum += kl
        per_sample.append(kl / len(ids))
        agree += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        tokens += len(ids)
    return Scores(loss.perplexity(), kl_sum / tokens, agree / tokens, lost, tuple(per_sample))


def paired_se(a: Scores, b: Scores) -> float:
    """Standard error of the mean per-sample KL difference a - b (the noise of comparing two scales)."""
    diff = torch.tensor(a.kl_per_sample, dtype=torch.float64) - torch.tensor(b.kl_per_sample, dtype=torch.float64)
    return float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
