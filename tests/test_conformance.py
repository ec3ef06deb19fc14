"""Conformance: fp8kv's reference log-probabilities name every simulated engine bug, and correct output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.cli import app
from fp8kv.conformance.pack import BF16_CACHE, MODEL_DIR, PACK_JSON, ConformancePack, read_pack, write_answers
from fp8kv.conformance.request import CORRECT, ReferenceRequest, SimulateRequest, behaviour_engine
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.conformance.run import (
    ConformanceResult, _scaled, bf16_cache_logprobs, check, distance, prompt_logprobs, reference, simulate,
    straddling_factors,
)
from fp8kv.data import DataRequest
from fp8kv.engine_models import BUGS
from fp8kv.errors import Fp8kvError
from fp8kv.runtime.runner import load_model


@pytest.fixture(scope="module")
def pack(tmp_path_factory, corpus) -> Path:
    from fp8kv.tools.factory import make_checkpoint

    root = tmp_path_factory.mktemp("conformance")
    src = make_checkpoint("llama", root / "src")
    calibrate(CalibrationRequest(model=str(src), out=root / "calibrated", batch_size=3,
                                 data=DataRequest(corpus, num_samples=6, seq_len=48)))
    written = reference(ReferenceRequest(root / "calibrated", root / "pack"))
    assert written.behaviours == (CORRECT, *BUGS) and written.same_as_correct == () and written.separation > 0
    assert written.bf16_cache
    return root / "pack"


@pytest.mark.parametrize("behaviour", [CORRECT, *BUGS])
def test_check_names_every_simulated_behaviour(pack, behaviour, tmp_path):
    simulate(SimulateRequest(pack, behaviour, tmp_path / "engine.jsonl"))
    result = check(pack, tmp_path / "engine.jsonl")
    assert result.match == behaviour and result.distances[behaviour] == 0.0
    assert all(d > 0 for name, d in result.distances.items() if name != behaviour), result.distances


def test_a_straddling_factor_loses_some_prompts_and_keeps_others_without_a_clamp(pack):
    # A prompt that crosses the fp8 limit anywhere is lost whole without a clamp (a NaN value reaches every
    # earlier query), as every prompt is when an e4m3 cache is read as e5m2; a factor between two prompts'
    # largest values leaves one finite and keeps the two bugs apart.
    readout = read_kv_scales(pack.parent / "calibrated")
    assert readout.scales is not None
    prompts, source = read_pack(pack)[0].prompts, readout.source.path
    model = load_model(source, torch.device("cpu"))
    factors = straddling_factors(source, readout.scales, prompts, "cpu", model)
    assert factors
    for factor in factors:
        logprobs = prompt_logprobs(source, _scaled(readout.scales, factor), prompts, "no-clamp", "cpu", model)
        lost = [bool(values.isnan().any()) for values in logprobs.values()]
        assert any(lost) and not all(lost), (factor, lost)


def test_the_cli_prints_json_and_exits_3_unless_correct(pack, tmp_path):
    runner = CliRunner()
    for behaviour, code in ((CORRECT, 0), ("no-clamp", 3)):
        answers = tmp_path / f"{behaviour}.jsonl"
        made = runner.invoke(app, ["conformance", "simulate", str(pack), "--bug", behaviour, "--out", str(answers)])
        assert made.exit_code == 0, made.output
        result = runner.invoke(app, ["conformance", "check", str(pack), str(answers), "--json"])
        assert result.exit_code == code, result.output
        data = json.loads(result.stdout)
        assert data["match"] == behaviour and set(data["distances"]) == {CORRECT, *BUGS} and data["arithmetic"] is None
        # no-clamp differs from correct only through the tokens it loses
        assert data["close"] and (data["nonfinite"] == 0) == (behaviour == CORRECT)
    # one token lost (null, as vLLM writes a NaN log-probability) where the correct behaviour keeps it: still
    # nearest to correct, but an engine that loses tokens is not correct
    lines = (tmp_path / f"{CORRECT}.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["logprobs"][3] = None
    (tmp_path / "lost.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    result = runner.invoke(app, ["conformance", "check", str(pack), str(tmp_path / "lost.jsonl"), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 3 and (data["match"], data["nonfinite"]) == (CORRECT, 1), result.output


def test_a_behaviour_that_loses_one_token_more_or_less_is_still_a_close_match(pack, tmp_path):
    # Another CPU's bf16 arithmetic pushes a value on the edge of the fp8 range across it, or not: the lost
    # tokens start one token earlier or later. That is judged as one token, not as a distance of FLOOR.
    simulate(SimulateRequest(pack, "no-clamp", tmp_path / "no-clamp.jsonl"))
    _, logprobs = read_pack(pack)
    rows = [json.loads(line) for line in (tmp_path / "no-clamp.jsonl").read_text().splitlines()]
    # a prompt lost from a token on (not from its first, as a NaN key at the start of a prompt loses it whole)
    lost = next(row for row in rows if None in row["logprobs"] and row["logprobs"][0] is not None)
    first = lost["logprobs"].index(None)
    for shifted in (first - 1, first):  # one more token lost; the first lost one kept with the correct value
        values = [math.nan if v is None else v for v in lost["logprobs"]]
        values[shifted] = math.nan if shifted < first else float(logprobs[CORRECT][lost["id"]][shifted])
        write_answers(tmp_path / "engine.jsonl", {row["id"]: values if row is lost else
                                                  [math.nan if v is None else v for v in row["logprobs"]]
                                                  for row in rows})
        result = check(pack, tmp_path / "engine.jsonl")
        assert (result.match, result.lost, result.kept_distance) == ("no-clamp", 1, 0.0), result
        assert result.distances["no-clamp"] > result.separation / 2  # one floored token outweighs the margin
        assert result.close and 2 <= result.lost_separation, result


def test_the_pack_round_trips_and_answers_are_checked(pack, tmp_path):
    text = (pack / PACK_JSON).read_text()
    assert ConformancePack.from_json(text, "x").to_json() == text
    loaded, logprobs = read_pack(pack)
    first = loaded.prompts[0]
    assert logprobs[CORRECT][first.id].shape == (len(first.token_ids) - 1,)
    answers = tmp_path / "a.jsonl"
    # vLLM's prompt_logprobs start with null for the first token: accepted
    lines = [json.dumps({"id": p.id, "logprobs": [None, *logprobs[CORRECT][p.id].tolist()]}) for p in loaded.prompts]
    answers.write_text("\n".join(lines) + "\n")
    result = check(pack, answers)
    assert (result.match, result.distances[CORRECT], result.separation) == (CORRECT, 0.0, loaded.separation)
    answers.write_text(lines[0] + "\n")
    with pytest.raises(Fp8kvError, match=r"a.jsonl: no answer for prompts \['p1', 'p2', 'p3'\]"):
        check(pack, answers)
    answers.write_text(json.dumps({"id": first.id, "logprobs": [0.0]}) + "\n")
    with pytest.raises(Fp8kvError, match=f"a.jsonl:1: prompt p0 has 1 log-probabilities; the pack expects "
                                         f"{len(first.token_ids) - 1}"):
        check(pack, answers)
    answers.write_text("\n".join([lines[0], *lines]) + "\n")
    with pytest.raises(Fp8kvError, match="a.jsonl:2: a second answer for prompt p0"):
        check(pack, answers)
    answers.write_text(json.dumps({"id": first.id, "logprobs": [0.5] * (len(first.token_ids) - 1)}) + "\n")
    with pytest.raises(Fp8kvError, match="a.jsonl:1: a log-probability above 0 \\(0.5\\); write log p"):
        check(pack, answers)
    with pytest.raises(Fp8kvError, match="unknown behaviour 'raw'"):
        simulate(SimulateRequest(pack, "raw", tmp_path / "b.jsonl"))


@pytest.mark.parametrize(("damage", "message"), [
    ("answers-binary", r"a.jsonl: cannot be read as UTF-8 text"),
    ("answers-folder", r"answers: a folder, not a file"),
    ("answers-list", r"a.jsonl:1: not a \{\"id\": ..., \"logprobs\": \[...\]\} object"),
    ("answers-bool", r"a.jsonl:1: logprobs must be numbers or null"),
    ("pack-json-binary", r"pack.json: cannot be read as UTF-8 text"),
    ("reference-truncated", r"reference.safetensors: not a readable safetensors file"),
    ("reference-wrong-length", r"reference.safetensors: correct/p0 is float32 \[3\]; the pack expects float32"),
    ("reference-wrong-dtype", r"reference.safetensors: correct/p0 is int64 \[\d+\]; the pack expects float32"),
])
def test_damaged_packs_and_answers_are_one_clear_error(pack, tmp_path, damage, message):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(pack, tmp_path / "pack", ignore=shutil.ignore_patterns(MODEL_DIR))
    answers = tmp_path / "a.jsonl"
    first = read_pack(pack)[0].prompts[0]
    simulate(SimulateRequest(pack, CORRECT, answers))
    reference = copy / "reference.safetensors"
    tensors = load_file(str(reference))
    if damage == "answers-binary":
        answers.write_bytes(b"\xff\xfe{}")
    elif damage == "answers-folder":
        answers = tmp_path / "answers"
        answers.mkdir()
    elif damage == "answers-list":
        answers.write_text("[1, 2]\n")
    elif damage == "answers-bool":
        answers.write_text(json.dumps({"id": first.id, "logprobs": [True] * (len(first.token_ids) - 1)}) + "\n")
    elif damage == "pack-json-binary":
        (copy / PACK_JSON).write_bytes(b"\xff\xfe")
    elif damage == "reference-truncated":
        reference.write_bytes(reference.read_bytes()[:100])
    elif damage == "reference-wrong-length":
        save_file({**tensors, f"{CORRECT}/{first.id}": torch.zeros(3)}, str(reference))
    elif damage == "reference-wrong-dtype":
        save_file({**tensors, f"{CORRECT}/{first.id}": tensors[f"{CORRECT}/{first.id}"].long()}, str(reference))
    with pytest.raises(Fp8kvError, match=message):
        check(copy, answers)


def test_a_reader_that_stops_reading_ends_check_quietly(pack, tmp_path):
    """`fp8kv conformance check PACK ANSWERS | head -1`: the closed pipe is no fp8kv error and no traceback;
    the command ends with the shell's 141."""
    import subprocess
    import sys

    simulate(SimulateRequest(pack, CORRECT, tmp_path / "engine.jsonl"))
    probe = "import sys\nfrom fp8kv.cli import main\nsys.argv = ['fp8kv', *sys.argv[1:]]\nmain()\n"
    proc = subprocess.Popen([sys.executable, "-c", probe, "conformance", "check", str(pack), str(tmp_path / "engine.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before the first line is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert "error" not in stderr and "Traceback" not in stderr, stderr


def bf16_cache_answers(pack: Path, out: Path, **arithmetic) -> Path:
    """The pack's prompts answered by fp8kv's runtime with a bf16 cache, in `arithmetic` (runner options)."""
    answers = bf16_cache_logprobs(pack / MODEL_DIR, read_pack(pack)[0].prompts, "cpu", **arithmetic)
    write_answers(out, {pid: values.tolist() for pid, values in answers.items()})
    return out


@pytest.fixture(scope="module")
def engine_bf16_answers(pack, tmp_path_factory) -> Path:
    """What an engine computing in bf16 with torch_xla's reference roundings answers with a bf16 cache."""
    return bf16_cache_answers(pack, tmp_path_factory.mktemp("engine") / "bf16.jsonl", dtype=torch.bfloat16,
                              attention_numerics="xla-reference")


@pytest.mark.parametrize("behaviour", [CORRECT, *BUGS])
def test_check_names_each_behaviour_computed_in_another_arithmetic(pack, behaviour, tmp_path, engine_bf16_answers):
    """An engine does not compute as fp8kv's float32 reference does: the same behaviour run with bf16 weights and
    torch_xla's reference roundings (K/V and probabilities in bf16) is still the one `check` names, and given the
    engine's answers with a bf16 cache, close to it."""
    prompts = read_pack(pack)[0].prompts
    scales = read_kv_scales(pack / MODEL_DIR).scales
    assert scales is not None
    answers = prompt_logprobs(pack / MODEL_DIR, scales, prompts, behaviour_engine(behaviour), "cpu",
                              dtype=torch.bfloat16, attention_numerics="xla-reference")
    write_answers(tmp_path / "engine.jsonl", {pid: values.tolist() for pid, values in answers.items()})
    result = check(pack, tmp_path / "engine.jsonl")
    assert result.match == behaviour and result.arithmetic is None, result.distances
    if any(bool(values.isfinite().any()) for values in answers.values()):  # a behaviour that loses every token
        assert result.distances[behaviour] > 0  # leaves nothing to differ; the others' arithmetic did differ
    judged = check(pack, tmp_path / "engine.jsonl", engine_bf16_answers)
    assert judged.distances == result.distances and judged.arithmetic is not None and judged.arithmetic > 0
    assert judged.close, (judged.distances, judged.arithmetic, judged.separation)


def test_the_engine_arithmetic_is_measured_against_a_bf16_cache(pack, tmp_path):
    _, logprobs = read_pack(pack)
    assert distance(logprobs[BF16_CACHE], logprobs[CORRECT]) > 0  # no fp8 write in it
    # fp8kv's own runtime with a bf16 cache computes exactly what the pack holds
    same = bf16_cache_answers(pack, tmp_path / "same.jsonl")
    simulate(SimulateRequest(pack, CORRECT, tmp_path / "engine.jsonl"))
    assert check(pack, tmp_path / "engine.jsonl", same).arithmetic == 0.0
    result = CliRunner().invoke(app, ["conformance", "check", str(pack), str(tmp_path / "engine.jsonl"),
                                      "--bf16-answers", str(same)])
    assert result.exit_code == 0 and "the engine's own arithmetic, both with bf16 caches: 0" in result.output
    # answers from an fp8 cache given as the bf16 ones: refused, naming the fp8 behaviour they match
    with pytest.raises(Fp8kvError, match="engine.jsonl: these answers lie nearer fp8kv's correct \\(an fp8 cache\\)"):
        check(pack, tmp_path / "engine.jsonl", tmp_path / "engine.jsonl")
    # the margin for a close match is half the separation plus that arithmetic
    assert ConformanceResult(CORRECT, {CORRECT: 0.08}, separation=0.1, arithmetic=0.04, kept_distance=0.08).close
    assert not ConformanceResult(CORRECT, {CORRECT: 0.08}, separation=0.1, kept_distance=0.08).close
    # a pack written before the bf16 reference: still checked, but cannot measure the arithmetic
    import shutil

    from safetensors.torch import load_file, save_file

    old = shutil.copytree(pack, tmp_path / "old", ignore=shutil.ignore_patterns(MODEL_DIR))
    meta = json.loads((old / PACK_JSON).read_text())
    del meta["bf16_cache"]
    (old / PACK_JSON).write_text(json.dumps(meta))
    tensors = load_file(str(old / "reference.safetensors"))
    save_file({k: t for k, t in tensors.items() if not k.startswith(BF16_CACHE)}, str(old / "reference.safetensors"))
    assert check(old, tmp_path / "engine.jsonl").match == CORRECT
    with pytest.raises(Fp8kvError, match="old: the pack has no bf16-cache log-probabilities .* write it again"):
        check(old, tmp_path / "engine.jsonl", same)
