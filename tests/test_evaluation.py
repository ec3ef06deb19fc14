"""lm-evaluation-harness on fp8kv's runtime, offline: a task defined here over a local jsonl, the bundled model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from fp8kv.data import DataRequest  # noqa: E402
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate  # noqa: E402
from fp8kv.checkpoint.artifacts import PROVENANCE_FILE  # noqa: E402
from fp8kv.checkpoint.kvscales import KVScales  # noqa: E402
from fp8kv.checkpoint.provenance import Provenance  # noqa: E402
from fp8kv.checkpoint.writer import write_checkpoint  # noqa: E402
from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.evaluation.bundled_tasks import QUESTIONS  # noqa: E402
from fp8kv.evaluation.request import report_folder  # noqa: E402
from fp8kv.evaluation.harness import Fp8kvLM  # noqa: E402
from fp8kv.evaluation.results import ConfigScores, EvalResults, read_results  # noqa: E402
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_MODEL_DIR  # noqa: E402
from fp8kv.runtime.runner import load_model  # noqa: E402

TASK_YAML = """
task: test_pydoc_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
"""
MC = "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
GEN = ("output_type: generate_until\ndoc_to_target: \"{{choices[answer] | trim}}\"\n"
       "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
       "filter_list:\n  - name: first_word\n    filter:\n"
       "      - function: regex\n        regex_pattern: \"^\\\\s*([^\\\\s.,:;]+)\"\n"
       "      - function: take_first\n"
       "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def weights() -> torch.nn.Module:
    return load_model(BUNDLED_MODEL_DIR, torch.device("cpu"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> TaskManager:
    """Two tasks written here: multiple choice and generation over a local jsonl of documentation questions."""
    root = tmp_path_factory.mktemp("tasks")
    data = root / "questions.jsonl"
    data.write_text(QUESTIONS.read_text())
    for kind, body in (("mc", MC), ("gen", GEN)):
        (root / f"{kind}.yaml").write_text(TASK_YAML.format(kind=kind, data=data) + body)
    return TaskManager(include_path=str(root), include_defaults=False)  # only these two: lm_eval's own are not indexed


def _questions() -> list[dict]:
    return [json.loads(line) for line in QUESTIONS.read_text().splitlines()]


def test_loglikelihoods_match_transformers_own_forward(weights: torch.nn.Module) -> None:
    """The harness's scores against log p(continuation | context) from transformers' forward of the same
    checkpoint (no fp8kv code): equal up to bf16 rounding, and the same best choice for every question."""
    lm = Fp8kvLM(str(BUNDLED_MODEL_DIR), kv_cache="bf16", device="cpu", batch_size=4, model=weights)
    questions = _questions()[:3]
    pairs = [(q["question"], c) for q in questions for c in q["choices"]]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs], disable_tqdm=True)
    reference = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR).eval()
    expected = []
    for context, continuation in pairs:
        ctx = lm.tok_encode(context)
        cont = lm.tok_encode(context + continuation)[len(ctx):]
        with torch.no_grad():
            logits = reference(torch.tensor([ctx + cont[:-1]])).logits[0, -len(cont):].float()
        logp = torch.log_softmax(logits, dim=-1)  # [len(cont), vocab]
        expected.append(float(logp.gather(1, torch.tensor(cont)[:, None]).double().sum()))
    # bf16 weights and activations: the two attention codes round differently, about 0.1 nats over a sum
    # of 50; an off-by-one window or a missed BOS moves a sum by whole nats.
    assert [score for score, _ in got] == pytest.approx(expected, rel=0.01, abs=0.05)
    start = 0
    for question in questions:
        n = len(question["choices"])
        ours, theirs = [score for score, _ in got[start:start + n]], expected[start:start + n]
        assert ours.index(max(ours)) == theirs.index(max(theirs)), question["question"]
        start += n


def test_bundled_model_scores_above_chance_through_lm_eval(weights: torch.nn.Module, tasks: TaskManager) -> None:
    lm = Fp8kvLM(str(BUNDLED_MODEL_DIR), kv_cache="bf16", device="cpu", batch_size=16, model=weights)
    out = lm_eval.simple_evaluate(model=lm, tasks=["test_pydoc_mc", "test_pydoc_gen"], task_manager=tasks,
                                  log_samples=False, bootstrap_iters=0)
    assert out["results"]["test_pydoc_mc"]["acc,none"] > 0.5  # four choices: chance is 0.25
    assert out["results"]["test_pydoc_gen"]["exact_match,first_word"] > 0.0


@pytest.fixture(scope="module")
def quarter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with K/V scales a quarter of its calibrated ones: many values pass the fp8 range."""
    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=8, seq_len=128)
    scales = calibrate(CalibrationRequest(model=str(BUNDLED_MODEL_DIR), data=data, device="cpu")).scales
    quarter = KVScales({i: tuple(x / 4 for x in t) for i, t in scales.k.items()},
                       {i: tuple(x / 4 for x in t) for i, t in scales.v.items()})
    return write_checkpoint(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("quarter") / "ckpt", quarter)


def test_quarter_scales_score_lower_without_the_clamp_than_with_it(
        quarter: Path, weights: torch.nn.Module, tasks: TaskManager) -> None:
    acc, nonfinite = {}, {}
    for engine in ("vllm-tpu", "no-clamp"):
        lm = Fp8kvLM(str(quarter), kv_cache="fp8", scales="checkpoint", engine=engine, device="cpu", batch_size=16,
                     model=weights)
        out = lm_eval.simple_evaluate(model=lm, tasks=["test_pydoc_mc"], task_manager=tasks, limit=16,
                                      log_samples=False, bootstrap_iters=0)
        acc[engine] = out["results"]["test_pydoc_mc"]["acc,none"]
        nonfinite[engine] = sum(k + v for k, v in lm.runner.counts().nonfinite.values())
    assert nonfinite["vllm-tpu"] == 0 and nonfinite["no-clamp"] > 0
    assert acc["no-clamp"] < acc["vllm-tpu"]


def test_fp8kv_eval_command_writes_the_comparison(quarter: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fp8kv.cli import app

    result = CliRunner().invoke(app, ["eval", str(quarter), "--tasks", "fp8kv_pydoc_mc", "--limit", "8",
                                      "--engines", "no-clamp", "--device", "cpu", "--batch-size", "16",
                                      "--report", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    back = EvalResults.from_json((tmp_path / "r" / "results.json").read_text())
    assert [row.label for row in back.rows] == ["bf16", "fp8 unit no-clamp", "fp8 checkpoint no-clamp"]
    assert back.tasks == ("fp8kv_pydoc_mc",) and back.limit == 8 and back.device == "cpu"
    scores = {row.label: row.metrics["fp8kv_pydoc_mc acc"] for row in back.rows}
    stored = {row.label: row.nonfinite_stored for row in back.rows}
    assert stored["bf16"] == 0 and stored["fp8 unit no-clamp"] == 0 and stored["fp8 checkpoint no-clamp"] > 0
    assert set(stored) == {"bf16", "fp8 unit no-clamp", "fp8 checkpoint no-clamp"}
    assert scores["fp8 checkpoint no-clamp"] < scores["bf16"]
    assert (tmp_path / "r" / "results.md").read_text() == back.markdown()
    assert "| fp8 checkpoint no-clamp |" in result.output


def test_unknown_engine_and_missing_scales_are_one_line_errors(weights: torch.nn.Module) -> None:
    from fp8kv.evaluation.spec import CacheSpec, engine_arguments

    assert CacheSpec.parse("fp8", "checkpoint", "sglang").label == "fp8 checkpoint sglang@0.5.23"
    assert engine_arguments("sglang") == {"engine": "sglang"}
    with pytest.raises(Fp8kvError, match=r"unknown engine 'fast'; choose from vllm-cuda, .*, e5m2-read \(bugs\)"):
        Fp8kvLM(str(BUNDLED_MODEL_DIR), engine="fast", device="cpu", model=weights)
    with pytest.raises(Fp8kvError, match="no KV scales in any convention; use scales=unit"):
        Fp8kvLM(str(BUNDLED_MODEL_DIR), kv_cache="fp8", scales="checkpoint", device="cpu", model=weights)


def test_results_round_trip_and_report_folder_rule(tmp_path: Path) -> None:
    row = ConfigScores("fp8 checkpoint sglang", "fp8", "checkpoint", "sglang", {"t acc": 0.5, "t ppl": float("nan")}, 7)
    result = EvalResults("ckpt", ("t",), 10, "cpu", (row,))
    folder = tmp_path / "ckpt"
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(result.to_json())
    back = read_results(folder)
    assert back is not None and back.rows[0].metrics["t acc"] == 0.5 and back.rows[0].nonfinite_stored == 7
    assert "| fp8 checkpoint sglang | 0.5 | NaN | 7 |" in back.markdown()
    with pytest.raises(Fp8kvError, match="not written by fp8kv .no fp8kv.json.; pass --report"):
        report_folder(folder, None)
    assert report_folder(folder, tmp_path / "r") == tmp_path / "r"
    (folder / PROVENANCE_FILE).write_text(Provenance(version="0.1.0", command=None, format="vllm-json").to_json())
    assert report_folder(folder, None) == folder / "eval"
