"""Runtime checks on fp8kv's paged cache: scale read-back, saturation, NaN with clamping, accuracy.

Three runners hold the same model: a bf16 cache (the reference), an fp8 cache with the
checkpoint's scales (clamped writes, as engines should do) and an fp8 cache with unit scales;
one more per engine model (`verify.engines`) that writes other bytes than these (engines whose
writes are the same arithmetic share a runner; an engine whose write differs reuses fp8's score of every
sequence in which fp8's cache saw it write each value alike, and a non-saturating engine its saturating
twin's of every sequence in which no value passed the fp8 maximum). By default every engine
attends with fp8kv's float32 attention, so engines are told apart by the bytes they write alone;
`engine_attention` also reproduces each engine's attention arithmetic (one more runner per arithmetic); a
hardware path's attention (vLLM CPU's amx) is always reproduced: one more runner at these scales and one at unit
scales, over the same write.
Each engine is also run at unit scales with its own write, what its scales are compared with (the
unit-scale runner wherever that write is exact at 1.0). Every held-out sample is prefilled on each; the
logits give perplexity, KL(bf16 || fp8) of every next-token distribution and top-1 agreement, per
engine. The fp8 cache's counters give the exact share of
values clamped at ±MAX and any NaN/inf stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.data import repeated_prefixes
from fp8kv.engine_models import DEFAULT_ENGINE, EngineModel, as_engine_model, engine_model, ignored
from fp8kv.runtime.cache import Scale
from fp8kv.runtime.device import resolve_device
from fp8kv.geometry import AttentionGeometry
from fp8kv.runtime.runner import PagedModelRunner, SequenceWrites, load_model, runs_ragged_attention
from fp8kv.checks import FAIL
from fp8kv.verify.engines import BUG, PASS, first_nonfinite_layer
from fp8kv.verify.intervals import paired_difference
from fp8kv.verify.results import Accuracy, CacheShares, EngineResult, PairedDifference, QueryCost, Readback


@dataclass
class Runners:
    """The reference (bf16 cache), the checkpoint's scales and unit scales, on one device.

    `engines` maps each engine model's name to its runner and `models` to the model (resolved for the checkpoint
    where the caller did so); engines whose writes are the same arithmetic share one (the default engine's is `fp8`, "scales-ignored" runs on `unit`).
    `unit_engines` maps each engine to its runner at scale 1.0 with its own write, what it compares these
    scales with: at 1.0 every division and reciprocal here is exact, so only a truncating or non-saturating
    conversion needs a runner besides `unit`; an engine that ignores the scales maps to its own runner. `shadows` are the engines whose
    writes `fp8`'s cache also computes: a batch in which none of their values differs from `fp8`'s gives
    `fp8`'s logits. `twins` maps a non-saturating engine to the runner of its saturating twin, whose
    values it shares wherever |x / scale| <= MAX.
    """

    bf16: PagedModelRunner
    fp8: PagedModelRunner
    unit: PagedModelRunner
    engines: dict[str, PagedModelRunner]
    twins: dict[str, PagedModelRunner] = field(default_factory=dict)
    shadows: tuple[str, ...] = ()
    models: dict[str, EngineModel] = field(default_factory=dict)
    unit_engines: dict[str, PagedModelRunner] = field(default_factory=dict)

    @classmethod
    def open(cls, model_dir: Path, scales: KVScales, kv_layers: tuple[int, ...], *, device: str,
             max_model_len: int, max_num_seqs: int, page_size: int = 16,
             engines: tuple[str | EngineModel, ...] = (DEFAULT_ENGINE,), engine_attention: bool = False) -> Runners:
        # One copy of the weights serves every cache: only the caches differ.
        model = load_model(model_dir, resolve_device(device).device)
        common = dict(device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs, page_size=page_size,
                      model=model)
        k, v = runtime_scales(scales, kv_layers)
        # the torch attention reproduces a hardware path's attention always and an engine's on request; torch_xla's
        # runs its own, and a model attending in its own code or over MLA latents keeps its own (each runner's
        # `arithmetic` says which)
        ragged = (not resolve_device(device).is_xla
                  and runs_ragged_attention(model, AttentionGeometry.from_dir(model_dir)))
        numerics = (lambda m: m.numerics(engine_attention)) if ragged else (lambda m: None)
        engine_models = {model.name: model for model in map(as_engine_model, engines)}
        key = {name: engine.write_key(numerics(engine)) for name, engine in engine_models.items()}
        reference = engine_model(DEFAULT_ENGINE)  # on fp8kv's own float32 attention
        # a truncating engine stores another byte for a third to a half of all values, so every sequence differs:
        # counting its differences would be wasted work
        # one shadow per distinct write: engines with equal keys share a runner, and so its logits
        shadows = tuple({key[name]: name for name, engine in engine_models.items() if key[name] != reference.write_key()
                         and engine.read_key(numerics(engine)) == reference.read_key() and not engine.truncates}.values())
        fp8 = PagedModelRunner(model_dir, cache_dtype=scales.kv_dtype, k_scales=k, v_scales=v,
                               shadow_engines=[engine_models[name] for name in shadows], **common)
        unit = PagedModelRunner(model_dir, cache_dtype=scales.kv_dtype, **common)
        # the unit-scale runner is exactly an engine that never received its scales
        shared = {reference.write_key(): fp8, engine_model("scales-ignored").write_key(): unit}
        at_unit = {name: replace(engine, loads=ignored) for name, engine in engine_models.items()}
        unit_key = {name: engine.write_key(numerics(engine_models[name])) for name, engine in at_unit.items()}
        for keys, models in ((key, engine_models), (unit_key, at_unit)):
            for name, engine in models.items():
                if keys[name] not in shared:
                    shared[keys[name]] = PagedModelRunner(model_dir, cache_dtype=scales.kv_dtype, k_scales=k,
                                                          v_scales=v, engine=engine,
                                                          attention_numerics=numerics(engine), **common)
        twin_keys = {name: engine.write_key(numerics(engine), saturate=True) for name, engine in engine_models.items()
                     if not engine.saturate}
        twins = {name: shared[twin] for name, twin in twin_keys.items() if twin in shared}
        return cls(PagedModelRunner(model_dir, cache_dtype="bf16", **common), fp8, unit,
                   {name: shared[key[name]] for name in engine_models}, twins, shadows, engine_models,
                   {name: shared[unit_key[name]] for name in engine_models})


def runtime_scales(scales: KVScales, kv_layers: tuple[int, ...]) -> tuple[dict[int, Scale], dict[int, Scale]]:
    """The runner's scale arguments: a float per layer, or a list per KV head."""

    def one(values: tuple[float, ...]) -> Scale:
        return values[0] if scales.strategy == "tensor" else list(values)

    return {i: one(scales.k[i]) for i in kv_layers}, {i: one(scales.v[i]) for i in kv_layers}


def readback(runner: PagedModelRunner, scales: KVScales) -> Readback:
    """Compare the scales the runner's cache writes and attends with against the file, bit for bit in float32.

    Each value the cache holds (its per-layer scale table and the attention's scale argument) must
    be exactly representable in float32 and have the file's float32 bits.
    """
    cache, mismatches = runner.cache, []
    for row, layer in enumerate(cache.kv_layers):
        attn_k, attn_v = cache.scale_args(layer)
        heads = cache.layer_kv_heads(layer)  # the table's row is as wide as the layer with most KV heads
        for name, held, attn, stored in (("k_scale", cache.scales[row, 0, :heads], attn_k, scales.tensor("k", layer)),
                                         ("v_scale", cache.scales[row, 1, :heads], attn_v, scales.tensor("v", layer))):
            for what, value in (("cache", held), ("attention", attn)):
                if not _same_bits(value, stored):
                    mismatches.append(f"layer {layer}: {name} in the {what} is {_shown(value, stored)}, "
                                      f"the file has {stored.flatten().tolist()}")
    return Readback(not mismatches, len(cache.kv_layers), tuple(mismatches))


def _values(value: float | tuple[float, ...] | torch.Tensor) -> list[float]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().flatten().tolist()
    return [float(value)] if isinstance(value, (int, float)) else [float(x) for x in value]


def _shown(value: float | tuple[float, ...] | torch.Tensor, stored: torch.Tensor) -> list[float]:
    """The runner's values as the file spells them: a per-layer scale once, not once per KV head."""
    values = _values(value)
    return values[:1] if stored.numel() == 1 and len(set(values)) == 1 else values


def _same_bits(value: float | tuple[float, ...] | torch.Tensor, stored: torch.Tensor) -> bool:
    held = torch.tensor(_values(value), dtype=torch.float64)
    file = stored.flatten()
    # one value stands for every KV head: the cache's table holds a per-layer scale once per head
    if file.numel() == 1:
        file = file.expand_as(held)
    if held.numel() == 1:
        held = held.expand_as(file)
    if held.shape != file.shape:
        return False
    exact = torch.equal(held.float().double(), held)  # nothing lost when the runner's value is read as float32
    return exact and torch.equal(held.float().view(torch.int32), file.view(torch.int32))


def sequence_nll(ids: list[int], logp: torch.Tensor) -> float:
    """The negative log-likelihood of each token of `ids` [L] given the ones before it, summed, from the sample's
    log-probabilities [L, vocab]."""
    return -float(_next_token_logp(ids, logp, slice(0, len(logp))).double().sum())


@dataclass
class NextTokenLoss:
    """Running negative log-likelihood of each token given the ones before it; its perplexity."""

    nll: float = 0.0
    predicted: int = 0  # tokens scored (every token after a sample's first)

    def add(self, ids: list[int], logp: torch.Tensor) -> float:
        """Fold one sample: `ids` [L] and its log-probabilities [L, vocab]; returns the sample's own NLL."""
        nll = sequence_nll(ids, logp)
        self.nll += nll
        self.predicted += len(ids) - 1
        return nll

    def perplexity(self) -> float:
        return math.exp(self.nll / max(self.predicted, 1)) if math.isfinite(self.nll) else math.nan


# Logit rows scored at a time, as many as fill about 4 MB of float32 (4 rows of a 262k vocabulary, 21 of 49k):
# each row block's log-softmax, exp and KL temporaries, a few blocks' worth, stay in the CPU's cache, where they
# run several times faster than over a whole sequence's [L, vocab], with the same sums per row (237 rows of 262k:
# on an AMD EPYC 111 ms in 8 MB blocks against 422 ms; on an Intel Xeon with 2 MB of L2 per core 211 ms in 4 MB
# blocks against 323 ms in 8 MB ones, and 35 against 52 ms on 49k).
ROW_BLOCK_ELEMENTS = 1 << 20


def _rows_per_block(vocab: int) -> int:
    return max(1, ROW_BLOCK_ELEMENTS // vocab)


def _row_blocks(rows: int, vocab: int) -> list[slice]:
    step = _rows_per_block(vocab)
    return [slice(start, start + step) for start in range(0, rows, step)]


def _bad_rows(logits: torch.Tensor) -> int:
    """Rows of `logits` with a NaN/inf: only rows whose sum is not finite can hold one (or finite logits summing
    past float32's range)."""
    suspects = logits[~torch.isfinite(logits.sum(-1))]
    return int((~torch.isfinite(suspects)).any(-1).sum())


def _block_kl(ref_logp: torch.Tensor, logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) of each row of a row block, float32: exp(ref) * (ref - other) summed, formed in `logp`'s
    own storage (overwritten) with `weights` (as large) for exp(ref). Temporaries of a block's size would each be
    new memory from the operating system: reusing two buffers halves the time on a 262k vocabulary (256 rows in
    4 MB blocks: 103 ms against 221 ms), the same sums. (kl_div with a log target computes them too, but over row
    blocks it takes about 4x as long.)"""
    torch.sub(ref_logp, logp, out=logp)
    return logp.mul_(torch.exp(ref_logp, out=weights)).sum(-1)


def _agrees_with(logp: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """Per row of `logp` `[rows, vocab]`, whether its argmax is `top1` `[rows]`, exactly as argmax answers (the first
    of tied largest values; a NaN counts as largest): whether the value at `top1` beats the largest of the others,
    found by a max over the row with that one value set aside for it (a tenth of argmax's time on a 262k
    vocabulary, whose index-tracking pass is not vectorized). A row where neither is larger, a tie or a NaN, asks
    argmax itself. `logp` is left as it was."""
    at = top1[:, None]
    own = logp.gather(1, at)
    others = logp.scatter_(1, at, -math.inf).amax(-1, keepdim=True)
    logp.scatter_(1, at, own)
    agrees = (own > others)[:, 0]
    unsure = ~(agrees | (own < others)[:, 0])
    if unsure.any():
        agrees[unsure] = logp[unsure].argmax(-1) == top1[unsure]
    return agrees


def _next_token_logp(ids: list[int], logp: torch.Tensor, rows: slice) -> torch.Tensor:
    """The log-probability row block `rows` of `logp` gives each token of `ids` after its row."""
    start = rows.start
    targets = torch.tensor(ids[start + 1 : start + len(logp) + 1], dtype=torch.long)
    return logp[: len(targets)].gather(1, targets[:, None])[:, 0]


class _LogSoftmaxBlocks:
    """The float32 log-softmax of one sequence's `logits` [L, vocab] (any float dtype), one row block at a time
    (`(rows, logp)` pairs), gathering on the way what every score of the sequence needs: each next token's
    log-probability (`nll`, once iterated) and the rows with a NaN/inf logit (`bad_rows`). Each block lands in
    `out`'s rows where given, else in one block's buffer that the next block reuses: use a block before the next."""

    def __init__(self, ids: list[int], logits: torch.Tensor, out: torch.Tensor | None = None) -> None:
        self.ids, self.logits, self.out = ids, logits, out
        self.bad_rows = 0
        self._token_logp: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[tuple[slice, torch.Tensor]]:
        length, vocab = self.logits.shape
        buffer = self.out if self.out is not None else torch.empty(min(_rows_per_block(vocab), length), vocab)
        for rows in _row_blocks(length, vocab):
            block = self.logits[rows]
            logp = buffer[rows] if self.out is not None else buffer[: len(block)]
            torch.log_softmax(block, dim=-1, dtype=torch.float32, out=logp)  # converted as it goes: no float copy
            self._token_logp.append(_next_token_logp(self.ids, logp, rows))
            self.bad_rows += _bad_rows(block)
            yield rows, logp

    @property
    def nll(self) -> float:
        return -float(torch.cat(self._token_logp).double().sum())


@dataclass(frozen=True)
class ScoredSample:
    """The bf16 cache's logits for one sequence as every runner is scored against them: log-probabilities
    [L, vocab] (float32 log-softmax: KL agrees with float64 to ~3e-5 relative on 32k vocabularies at a third of
    the time), each row's most likely token, the sequence's negative log-likelihood and its rows with a NaN/inf
    logit. (Its probabilities are not kept: on a 262k vocabulary they would double what a batch's references hold.)
    """

    logp: torch.Tensor
    top1: torch.Tensor
    nll: float
    bad_rows: int

    @classmethod
    def of(cls, ids: list[int], logits: torch.Tensor) -> ScoredSample:
        logp = torch.empty(logits.shape, dtype=torch.float32)
        blocks = _LogSoftmaxBlocks(ids, logits, out=logp)
        for _ in blocks:
            pass
        return cls(logp, logp.argmax(-1), blocks.nll, blocks.bad_rows)


@dataclass(frozen=True)
class SequenceScore:
    """One runner's logits for one held-out sequence against the bf16 cache's: KL(bf16 || runner) summed over its
    rows and its largest (NaN where any is), rows whose top-1 token agrees, the sequence's negative
    log-likelihood, and rows with a NaN/inf logit."""

    kl_sum: float
    kl_max: float
    top1: int
    nll: float
    bad_rows: int

    @classmethod
    def of(cls, ids: list[int], logits: torch.Tensor, reference: ScoredSample) -> SequenceScore:
        """Score `logits` [L, vocab] (any float dtype) one row block at a time: no [L, vocab] temporary is made."""
        kl, top1, blocks = [], 0, _LogSoftmaxBlocks(ids, logits)
        weights: torch.Tensor | None = None
        for rows, logp in blocks:
            top1 += int(_agrees_with(logp, reference.top1[rows]).sum())
            weights = torch.empty_like(logp) if weights is None else weights[: len(logp)]
            kl.append(_block_kl(reference.logp[rows], logp, weights))  # NaN logits give NaN
        kls = torch.cat(kl).double()
        return cls(float(kls.sum()), float(kls.max()), top1, blocks.nll, blocks.bad_rows)

    @classmethod
    def reference(cls, sample: ScoredSample) -> SequenceScore:
        """The bf16 cache scored against itself."""
        return cls(0.0, 0.0, len(sample.top1), sample.nll, sample.bad_rows)


@dataclass
class Totals:
    """Per held-out sequence: the bf16 cache's NLL, and the scores of one fp8 runner (`ours`) and of the same
    cache at unit scales (`unit`); `paired` is False where the two are one runner (nothing to compare)."""

    paired: bool = True
    bf16_nll: list[float] = field(default_factory=list)
    ours: list[SequenceScore] = field(default_factory=list)
    unit: list[SequenceScore] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # distributions compared in each sequence

    def add(self, rows: int, bf16_nll: float, ours: SequenceScore, unit: SequenceScore) -> None:
        self.bf16_nll.append(bf16_nll)
        self.ours.append(ours)
        self.unit.append(unit)
        self.rows.append(rows)

    @property
    def predicted(self) -> list[int]:
        """Tokens predicted in each sequence (every token after its first)."""
        return [rows - 1 for rows in self.rows]

    def versus_unit(self) -> tuple[PairedDifference, ...]:
        """Each measure of the fp8 cache against the unit-scale one, paired by sequence; none where either holds a
        non-finite value (those fail on their own) or a single sequence leaves nothing to resample."""
        if not self.paired or len(self.rows) < 2:
            return ()
        found = []
        for measure, figure in (("kl_mean", "kl_sum"), ("top1_agreement", "top1"), ("nll", "nll")):
            ours = [getattr(s, figure) for s in self.ours]
            theirs = [getattr(s, figure) for s in self.unit]
            if all(math.isfinite(v) for v in ours + theirs):
                tokens = self.predicted if measure == "nll" else self.rows
                found.append(paired_difference(measure, ours, theirs, tokens))
        return tuple(found)

    def summary(self) -> Accuracy:
        n, predicted = max(sum(self.rows), 1), max(sum(self.predicted), 1)

        def perplexity(nlls: list[float]) -> float:
            total = sum(nlls)
            return math.exp(total / predicted) if math.isfinite(total) else math.nan

        def kl_max(scores: list[SequenceScore]) -> float:
            values = [s.kl_max for s in scores]
            return max(values, default=0.0) if all(math.isfinite(v) for v in values) else math.nan

        return Accuracy(
            ppl_bf16=perplexity(self.bf16_nll), ppl_fp8=perplexity([s.nll for s in self.ours]),
            ppl_fp8_unit=perplexity([s.nll for s in self.unit]),
            kl_mean=sum(s.kl_sum for s in self.ours) / n, kl_max=kl_max(self.ours),
            top1_agreement=sum(s.top1 for s in self.ours) / n,
            kl_mean_unit=sum(s.kl_sum for s in self.unit) / n, kl_max_unit=kl_max(self.unit),
            top1_agreement_unit=sum(s.top1 for s in self.unit) / n,
            versus_unit=self.versus_unit(),
        )


@dataclass
class EngineTotals:
    """One engine model over the held-out samples: its scores against the bf16 cache and its unit-scale twin's."""

    totals: Totals

    def add(self, rows: int, bf16_nll: float, ours: SequenceScore, unit: SequenceScore) -> None:
        self.totals.add(rows, bf16_nll, ours, unit)

    def result(self, model: EngineModel, runner: PagedModelRunner) -> EngineResult:
        scores = self.totals.ours
        nan_rows = sum(s.bad_rows for s in scores)
        verdict = (FAIL if nan_rows or not model.starts else PASS) if model.released else BUG
        accuracy = self.totals.summary()
        return EngineResult(model.name, accuracy.ppl_fp8, nan_rows, sum(self.totals.rows),
                            sum(s.bad_rows > 0 for s in scores), len(scores), first_nonfinite_layer(runner),
                            model.source, verdict, runner.arithmetic,
                            model.unread or ("its fp8 cache runs at scale 1.0" if model.ignores_scales else ""),
                            model.known_by, accuracy, model.path.selected_by if model.path else "")


def token_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) of each row, float64 `[L]`, from log-probabilities `[L, vocab]` (left as they are)."""
    return torch.cat([_block_kl(ref_logp[rows], logp[rows].clone(), torch.empty_like(logp[rows]))
                      for rows in _row_blocks(*logp.shape)]).double()


def measure_accuracy(runners: Runners, samples: list[list[int]], batch_size: int,
                     progress: Callable[[int, int], None] | None = None) -> tuple[Accuracy, list[EngineResult]]:
    """Prefill every sample on every runner (`batch_size` sequences per step) and compare logits.

    A row whose context an earlier sample holds (`repeated_prefixes`: a chat template's first tokens) is scored in
    that sample alone: sixteen samples repeating one prediction are one piece of evidence, and counted sixteen
    times they would narrow every interval over sequences; a sample holding nothing new is left out.
    An engine's runner prefills only the sequences whose bytes it may write differently from a runner that ran
    already (`_borrowed`), and takes that runner's score of the others. Returns the comparison with the bf16
    cache and one result per engine model.
    """
    new = [(ids, repeated) for ids, repeated in zip(samples, repeated_prefixes(samples)) if repeated < len(ids)]
    samples, skips = [ids for ids, _ in new], [repeated for _, repeated in new]
    totals = Totals()
    engine_totals = {engine: EngineTotals(Totals(paired=runners.unit_engines.get(engine, runners.unit)
                                                  is not runner)) for engine, runner in runners.engines.items()}
    # saturating engines first: a non-saturating one may reuse its twin's scores
    order = sorted(runners.engines, key=lambda name: name in runners.twins)
    for start in range(0, len(samples), batch_size):
        batch, skip = samples[start : start + batch_size], skips[start : start + batch_size]
        # Only the reference's log-probabilities outlive a prefill: every other runner's logits are scored as they
        # come, so a batch holds two vocabularies of logits at a time, not one per runner.
        references = [ScoredSample.of(ids[n:], out[n:])
                      for ids, n, out in zip(batch, skip, prefill(runners.bf16, batch, None))]
        ran = {id(runners.bf16): _Prefill([SequenceScore.reference(ref) for ref in references],
                                          list(runners.bf16.sequence_writes()))}
        for runner in (runners.fp8, runners.unit):
            if id(runner) not in ran:
                ran[id(runner)] = _Prefill.of(runner, batch, skip, references)
        for engine in order:
            runner = runners.engines[engine]
            if id(runner) not in ran:
                ran[id(runner)] = _Prefill.of(runner, batch, skip, references, _borrowed(engine, runners, ran))
        for runner in runners.unit_engines.values():
            if id(runner) not in ran:
                ran[id(runner)] = _Prefill.of(runner, batch, skip, references)
        del references  # before the next batch's reference prefill, which would otherwise hold two batches' worth
        for i, (ids, n) in enumerate(zip(batch, skip)):
            by_runner = {key: run.scores[i] for key, run in ran.items()}
            bf16_nll = by_runner[id(runners.bf16)].nll
            totals.add(len(ids) - n, bf16_nll, by_runner[id(runners.fp8)], by_runner[id(runners.unit)])
            for engine, runner in runners.engines.items():
                unit = runners.unit_engines.get(engine, runners.unit)
                engine_totals[engine].add(len(ids) - n, bf16_nll, by_runner[id(runner)], by_runner[id(unit)])
        if progress is not None:
            progress(start + len(batch), len(samples))
    results = [engine_totals[e].result(runners.models.get(e) or engine_model(e), runners.engines[e])
               for e in runners.engines]
    return totals.summary(), results


@dataclass(frozen=True)
class _Prefill:
    """One runner's score of each sequence of a batch and, where it ran the sequence itself, what its cache wrote
    for it (None where the score was borrowed from a runner proven to write the same bytes)."""

    scores: list[SequenceScore]
    writes: list[SequenceWrites | None]

    @classmethod
    def of(cls, runner: PagedModelRunner, batch: list[list[int]], skip: list[int], references: list[ScoredSample],
           borrowed: list[SequenceScore | None] | None = None) -> _Prefill:
        """Prefill the sequences of `batch` that `borrowed` has no score for (all, without it), scoring each against
        its reference (the bf16 cache's) as its logits arrive, from its row `skip[i]` on (the rows before repeat an
        earlier sample's)."""
        borrowed = borrowed or [None] * len(batch)
        todo = [i for i, lent in enumerate(borrowed) if lent is None]
        logits = prefill(runner, [batch[i] for i in todo], None) if todo else []
        writes = runner.sequence_writes() if todo else []
        scored = {i: SequenceScore.of(batch[i][skip[i]:], out[skip[i]:], references[i]) for i, out in zip(todo, logits)}
        wrote = dict(zip(todo, writes))
        return cls([lent if lent is not None else scored[i] for i, lent in enumerate(borrowed)],
                   [wrote.get(i) for i in range(len(batch))])


def _borrowed(engine: str, runners: Runners, ran: dict[int, _Prefill]) -> list[SequenceScore | None]:
    """Per sequence, the score `engine` would reproduce exactly, from a runner that ran it: fp8's where fp8's cache
    saw `engine` (a shadow) write every value alike; its saturating twin's where no value passed the fp8
    maximum, below which saturating or not stores the same bytes. None where `engine` must run itself."""
    fp8, twin = ran[id(runners.fp8)], runners.twins.get(engine)
    borrowed: list[SequenceScore | None] = [None] * len(fp8.scores)
    if engine in runners.shadows:
        borrowed = [score if w is not None and w.shadow_diffs[engine] == 0 else None
                    for score, w in zip(fp8.scores, fp8.writes)]
    if twin is not None and id(twin) in ran:
        mate = ran[id(twin)]
        borrowed = [lent if lent is not None else score if w is not None and w.over == 0 else None
                    for lent, score, w in zip(borrowed, mate.scores, mate.writes)]
    return borrowed


def query_cost(model_dir: Path, runners: Runners, scales: KVScales, samples: list[list[int]],
               batch_size: int, kl_mean_kv_only: float) -> QueryCost:
    """What quantizing Q with the checkpoint's q_scale costs on top of the fp8 cache: KL, top-1 and PPL vs bf16.

    A fourth runner holds the checkpoint's K/V scales and also reads the query as fp8(q / q_scale).
    """
    fp8 = runners.fp8
    layers = fp8.cache.kv_layers
    k, v = runtime_scales(scales, layers)
    with_query = PagedModelRunner(
        model_dir, device=fp8.runtime_device.kind, cache_dtype=scales.kv_dtype, k_scales=k, v_scales=v,
        q_scales={i: scales.q_value(i) for i in layers}, max_model_len=fp8.max_model_len,
        max_num_seqs=fp8.max_num_seqs, page_size=fp8.cache.page_size, model=fp8.model,
    )
    summary, _ = measure_accuracy(Runners(runners.bf16, with_query, runners.unit, {}), samples, batch_size)
    return QueryCost(summary.kl_mean, summary.kl_max, summary.top1_agreement, summary.ppl_fp8,
                     max(scales.q_value(i) for i in layers), kl_mean_kv_only)


def prefill(runner: PagedModelRunner, batch: list[list[int]],
            logits_dtype: torch.dtype | None = torch.float32) -> list[torch.Tensor]:
    """Prefill `batch` as one step (the sequences packed into one row) and free it; logits per sequence in
    `logits_dtype` (None: the model's own)."""
    seqs = [runner.start()[0] for _ in batch]
    logits = runner.step(list(zip(seqs, batch)), logits_dtype)
    for seq in seqs:
        runner.free(seq)
    return logits


def cache_shares(runner: PagedModelRunner) -> dict[int, CacheShares]:
    """Per KV layer of `runner`'s cache: shares of K and V values clamped at ±MAX, and NaN/inf values stored."""
    counts = runner.counts()
    return {layer: CacheShares(k / max(counts.written[layer], 1), v / max(counts.written[layer], 1),
                               sum(counts.nonfinite[layer]))
            for layer, (k, v) in counts.clamped.items()}
