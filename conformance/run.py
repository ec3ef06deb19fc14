"""Engine conformance: which fp8 KV behaviour does an engine have, the correct one or a known bug?

    reference(ReferenceRequest(model_dir, out))        fp8kv's log-probabilities on fixed prompts, per behaviour
    simulate(SimulateRequest(pack, "no-clamp", out))   an answer file from fp8kv's runtime with that behaviour
    check(pack, answers, bf16_answers)                 the behaviour the answers are closest to, and every distance

Each behaviour is an engine model (`fp8kv.engine_models`): "correct" is the write every engine should
do (float32 divide, saturate: vLLM's CUDA and TPU paths), the others are the bug models.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8kv.checkpoint.kvscales import KVScales, float32
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.conformance.pack import (
    BF16_CACHE, MODEL_DIR, ConformancePack, Prompt, check_pack_location, read_answers, read_pack, write_answers,
    write_pack,
)
from fp8kv.data import load_tokenizer
from fp8kv.conformance.request import (
    BEHAVIOURS, CORRECT, SCALE_FACTORS, ReferenceRequest, SimulateRequest, behaviour_engine, check_scale_factor,
)
from fp8kv.engine_models import BUGS
from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import RAW_CAST_FINITE_LIMIT
from fp8kv.progress import StageProgress, announce
from fp8kv.runtime.attention import AttentionNumerics
from fp8kv.runtime.runner import PagedModelRunner, load_model
from fp8kv.runtime.device import resolve_device
from fp8kv.verify.accuracy import prefill, runtime_scales
from fp8kv.verify.heldout import max_ratio_rows

# Fixed English prompts: ordinary text, so attention looks like it does in use.
PROMPT_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made "
    "books cheap enough for merchants, students and craftsmen to own.",
    "To make bread, mix flour, water, salt and yeast, knead the dough until it is smooth, let it rise "
    "for an hour, shape it, and bake it in a hot oven until the crust is brown.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Question: A train leaves at 9:15 and arrives at 11:45. How long is the journey? Answer: The "
    "journey takes two hours and thirty minutes.",
)
# Two prompts' largest |x| / scale lie apart when one exceeds the other by this ratio: a factor between them
# then leaves each clearly on its side of the limit.
STRADDLE_GAP = 1.02
# A log-probability is at least this (NaN and -inf count as this value): a lost token weighs as much
# as a very unlikely one, and distances stay finite.
FLOOR = -100.0


@dataclass(frozen=True)
class ConformanceResult:
    """The behaviour an engine's answers match (the nearest), the distance to every behaviour, and the answers'
    non-finite log-probabilities where the correct behaviour has finite ones (a correct engine has none).

    `arithmetic` is the distance between the engine's and fp8kv's answers with a bf16 cache, when the engine's
    were given: what the engine's own arithmetic (its matmuls and attention in another order and precision)
    adds to every distance, whatever its fp8 write does.
    """

    match: str
    distances: dict[str, float]
    separation: float = 0.0  # the pack's smallest distance between two behaviours
    nonfinite: int = 0
    arithmetic: float | None = None
    kept_distance: float = 0.0  # the match's distance over the tokens both it and the answers keep finite
    lost: int = 0  # tokens the answers lose and the match keeps, or keep where the match loses them
    lost_separation: int = 0  # the fewest such tokens between two behaviours that lose different tokens

    @property
    def close(self) -> bool:
        """Whether the answers lose the tokens the match loses, give or take half the fewest tokens on which two
        behaviours' losses differ, and on the tokens both keep lie within half the smallest distance between two
        behaviours, beyond the engine's own arithmetic where it was measured. Which tokens a NaN-producing
        behaviour loses shifts with the engine's arithmetic (a value on the edge of the range crosses it or not),
        so those are judged as tokens, apart from the finite rest."""
        return (2 * self.lost <= self.lost_separation
                and self.kept_distance <= (self.arithmetic or 0.0) + self.separation / 2)

    @property
    def correct(self) -> bool:
        """The engine behaves correctly: nearest to the correct behaviour, and no token lost where it keeps all."""
        return self.match == CORRECT and not self.nonfinite

    def to_json(self) -> str:
        return json.dumps({"match": self.match, "distances": self.distances, "separation": self.separation,
                           "close": self.close, "nonfinite": self.nonfinite, "arithmetic": self.arithmetic,
                           "kept_distance": self.kept_distance, "lost": self.lost,
                           "lost_separation": self.lost_separation}) + "\n"


def reference(request: ReferenceRequest, progress: StageProgress | None = None) -> ConformancePack:
    """Write the pack for the checkpoint at `request.model_dir` to `request.out`.

    PACK/model holds the source's scales x `scale_factor`; None tries `SCALE_FACTORS` and the straddling
    factors (`straddling_factors`) and keeps the one under which the behaviours lie furthest apart (the
    smallest distance between two of them is largest).
    """
    model_dir, out, device = request.model_dir, request.out, request.device
    check_pack_location(Path(out))  # before minutes of work, not after
    readout = read_kv_scales(model_dir)
    if readout.scales is None:
        raise Fp8kvError(f"{model_dir}: no KV scales; calibrate it first (fp8kv calibrate)")
    source = readout.source.path
    tokenizer = load_tokenizer(source, False)
    prompts = tuple(Prompt(f"p{i}", text, tuple(tokenizer(text)["input_ids"])) for i, text in enumerate(PROMPT_TEXTS))
    announce(progress, "loading the model")
    model = load_model(source, resolve_device(device).device)
    if request.scale_factor is None:
        factors = SCALE_FACTORS + straddling_factors(source, readout.scales, prompts, device, model)
    else:
        factors = (check_scale_factor(request.scale_factor),)
    tried = []
    for number, factor in enumerate(factors, 1):
        announce(progress, f"scales x{factor:.4g} ({number} of {len(factors)}): {len(BEHAVIOURS)} behaviours")
        scales = _scaled(readout.scales, factor)
        logprobs = {name: prompt_logprobs(source, scales, prompts, behaviour_engine(name), device, model)
                    for name in BEHAVIOURS}
        tried.append((separation(logprobs), factor, scales, logprobs))
    gap, factor, scales, logprobs = max(tried, key=lambda t: t[0])
    same = tuple(name for name in BUGS if distance(logprobs[name], logprobs[CORRECT]) == 0.0)
    announce(progress, "a bf16 cache")
    logprobs[BF16_CACHE] = bf16_cache_logprobs(source, prompts, device, model)
    pack = ConformancePack(str(model_dir), scales.kv_dtype, factor, prompts, BEHAVIOURS, same, gap, bf16_cache=True)
    write_pack(out, pack, logprobs,
               lambda folder: write_checkpoint(readout.source.path, folder, scales, mode=request.mode))
    return pack


def straddling_factors(model_dir: Path, scales: KVScales, prompts: tuple[Prompt, ...], device: str,
                       model: torch.nn.Module) -> tuple[float, ...]:
    """Scale factors under which some prompts pass the plain cast's limit and others stay below it: one between
    each two prompts' largest |x| / scale (over every K and V tensor) that lie apart.

    A write without a clamp loses a prompt from the first value past the limit on, and in a tiled attention
    kernel often every token of it (a NaN value reaches earlier queries through P x V's zero weights); an e4m3
    cache read as e5m2 is wrong on every prompt. Where no prompt crosses, the first looks correct; where every
    prompt crosses, it looks like the second. A prompt on each side tells all three apart.
    """
    limit = RAW_CAST_FINITE_LIMIT[scales.kv_dtype]
    largest = []
    for prompt in prompts:
        runner = PagedModelRunner(model_dir, device=device, cache_dtype="bf16", model=model,
                                  max_model_len=len(prompt.token_ids), max_num_seqs=1)
        prefill(runner, [list(prompt.token_ids)])
        rows = max_ratio_rows(runner.counts().amax, scales, runner.geometry.kv_layers)
        largest.append(max(max(row.k_max_ratio, row.v_max_ratio) for row in rows))
    ordered = sorted(largest)
    return tuple(float32(math.sqrt(low * high) / limit) for low, high in zip(ordered, ordered[1:])
                 if high > STRADDLE_GAP * low and 0 < math.sqrt(low * high) / limit <= 1)


def separation(logprobs: dict[str, dict[str, torch.Tensor]]) -> float:
    """The smallest distance between two behaviours: an engine's distance to its match should be far below it."""
    names = list(logprobs)
    return min(distance(logprobs[a], logprobs[b]) for i, a in enumerate(names) for b in names[i + 1:])


def simulate(request: SimulateRequest) -> None:
    """Write `request.out`: the pack's prompts answered by fp8kv's runtime with `request.behaviour` ("correct" or
    a bug)."""
    engine = behaviour_engine(request.behaviour)
    pack, _ = read_pack(request.pack_dir)
    model_dir = Path(request.pack_dir) / MODEL_DIR
    scales = read_kv_scales(model_dir).scales
    assert scales is not None  # the pack's model was written with scales
    answers = prompt_logprobs(model_dir, scales, pack.prompts, engine, request.device)
    write_answers(request.out, {pid: values.tolist() for pid, values in answers.items()})


def check(pack_dir: Path, answers_path: Path, bf16_answers_path: Path | None = None) -> ConformanceResult:
    """The behaviour nearest to the engine's answers (the first in the pack's order on a tie).

    `bf16_answers_path`: the same engine's answers with a bf16 cache, which measure its own arithmetic.
    """
    pack, logprobs = read_pack(pack_dir)
    answers = read_answers(answers_path, pack)
    arithmetic = None
    if bf16_answers_path is not None:
        if not pack.bf16_cache:
            raise Fp8kvError(f"{pack_dir}: the pack has no {BF16_CACHE} log-probabilities to measure the engine's "
                             "arithmetic against (written by an older fp8kv); write it again with fp8kv conformance "
                             "reference")
        bf16_answers = read_answers(bf16_answers_path, pack)
        arithmetic = distance(bf16_answers, logprobs[BF16_CACHE])
        to_fp8 = {name: distance(bf16_answers, logprobs[name]) for name in pack.behaviours}
        nearest = min(pack.behaviours, key=to_fp8.__getitem__)
        if to_fp8[nearest] < arithmetic:
            # vLLM, for one, keeps an fp8 cache under --kv-cache-dtype auto for a checkpoint that declares one
            raise Fp8kvError(f"{bf16_answers_path}: these answers lie nearer fp8kv's {nearest} (an fp8 cache) than its "
                             "bf16 cache, so the engine did not run a bf16 cache; serve the model without KV scales "
                             "(the pack's source)")
    distances = {name: distance(answers, logprobs[name]) for name in pack.behaviours}
    nonfinite = sum(int((~answers[pid].isfinite() & logprobs[CORRECT][pid].isfinite()).sum()) for pid in answers)
    match = min(pack.behaviours, key=distances.__getitem__)
    names = list(pack.behaviours)
    differing = [lost for i, a in enumerate(names) for b in names[i + 1:]
                 if (lost := lost_tokens(logprobs[a], logprobs[b]))]
    return ConformanceResult(match, distances, pack.separation, nonfinite, arithmetic,
                             kept_distance=distance(answers, logprobs[match], kept_only=True),
                             lost=lost_tokens(answers, logprobs[match]), lost_separation=min(differing, default=0))


def lost_tokens(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    """Tokens one of `a`, `b` has a non-finite log-probability for and the other a finite one."""
    return sum(int((a[pid].isfinite() ^ b[pid].isfinite()).sum()) for pid in b)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, kept_only: bool = False) -> float:
    """Mean |a - b| over every token of every prompt, with log-probabilities floored at `FLOOR`; `kept_only`: the
    share of that mean from the tokens both keep finite."""
    total = 0.0
    for pid in b:
        delta = (_floored(a[pid]) - _floored(b[pid])).abs()
        total += float(delta[a[pid].isfinite() & b[pid].isfinite()].sum() if kept_only else delta.sum())
    return total / max(sum(t.numel() for t in b.values()), 1)


def prompt_logprobs(model_dir: Path, scales: KVScales, prompts: tuple[Prompt, ...], engine: str, device: str,
                    model: torch.nn.Module | None = None, *, dtype: torch.dtype | None = None,
                    attention_numerics: AttentionNumerics | None = None) -> dict[str, torch.Tensor]:
    """log p(token i | tokens < i) for i >= 1 of every prompt, float32, from a runner writing as `engine`.

    `dtype` and `attention_numerics` compute as another engine might (weights in `dtype`, torch_xla's roundings):
    `PagedModelRunner`'s options of those names.
    """
    k, v = runtime_scales(scales, tuple(sorted(scales.k)))
    return runner_logprobs(PagedModelRunner(
        model_dir, device=device, cache_dtype=scales.kv_dtype, k_scales=k, v_scales=v, engine=engine, model=model,
        max_model_len=max(len(p.token_ids) for p in prompts), max_num_seqs=len(prompts), dtype=dtype,
        attention_numerics=attention_numerics), prompts)


def bf16_cache_logprobs(model_dir: Path, prompts: tuple[Prompt, ...], device: str, model: torch.nn.Module | None = None,
                        *, dtype: torch.dtype | None = None,
                        attention_numerics: AttentionNumerics | None = None) -> dict[str, torch.Tensor]:
    """`prompt_logprobs` with a bf16 cache, no fp8 write at all: what a pack's `BF16_CACHE` holds, and what an
    engine's own answers with a bf16 cache differ from by its arithmetic alone."""
    return runner_logprobs(PagedModelRunner(
        model_dir, device=device, cache_dtype="bf16", model=model, max_model_len=max(len(p.token_ids) for p in prompts),
        max_num_seqs=len(prompts), dtype=dtype, attention_numerics=attention_numerics), prompts)


def runner_logprobs(runner: PagedModelRunner, prompts: tuple[Prompt, ...]) -> dict[str, torch.Tensor]:
    """log p(token i | tokens < i) for i >= 1 of every prompt, float32, from `runner` (one prefill step)."""
    ids = [list(p.token_ids) for p in prompts]
    out = {}
    for prompt, rows, tokens in zip(prompts, prefill(runner, ids), ids):
        logp = torch.log_softmax(rows.float(), dim=-1)[:-1]
        out[prompt.id] = logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].cpu()
    return out


def _floored(values: torch.Tensor) -> torch.Tensor:
    return values.float().nan_to_num(FLOOR, FLOOR, FLOOR).clamp(min=FLOOR)


def _scaled(scales: KVScales, factor: float) -> KVScales:
    # float32 arithmetic, as a float32 scale tensor times `factor`: the exact product of two float32 values rounded once
    f = float32(factor)
    return dataclasses.replace(scales, k={i: tuple(float32(x * f) for x in t) for i, t in scales.k.items()},
                               v={i: tuple(float32(x * f) for x in t) for i, t in scales.v.items()})
