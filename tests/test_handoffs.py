"""The typed hand-offs: fp8kv.json and report.json round-trip through their types; a malformed file is one error."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from fp8kv.checkpoint.digest import CheckpointDigest
from fp8kv.checkpoint.provenance import ConvertedFrom, Provenance
from fp8kv.checks import FAIL, Finding
from fp8kv.errors import Fp8kvError
from fp8kv.inspection import ScaleRow
from fp8kv.runtime.xla_cost import Compiles, RuntimeSummary
from fp8kv.verify.report import PLOT, REPORT_JSON, REPORT_MD, HeldOut, VerifyReport, write_report
from fp8kv.verify.results import (
    Accuracy, EngineResult, Fidelity, GenerationDetails, GenerationMatch, LayerCheck, QueryCost, Readback,
    StaticSummary,
)
from fp8kv.verify.verdict import Thresholds

DIGEST = CheckpointDigest({"model.layers.0.self_attn.k_scale": "sha256:" + "0" * 64}, "sha256:" + "1" * 64,
                          {"model.safetensors": 1234})


def _report(**changes) -> VerifyReport:
    static = StaticSummary(("compressed-tensors",), {"compressed-tensors": True}, True, "tensor", (0, 1), (), ())
    fields = dict(checkpoint="/ckpt", digest=DIGEST, device="cpu", convention="compressed-tensors",
                  kv_dtype="fp8_e4m3", thresholds=Thresholds(0.01, 1e-4, 1.25, 0.05), static=static,
                  scales=(ScaleRow(0, 0.5, 0.25), ScaleRow(1, (0.5, 0.75), (0.25, 0.125))), verdict="FAIL",
                  exit_code=3, timings_s={"total": 0.5}, reasons=(Finding(FAIL, "held-out checks skipped"),))
    return VerifyReport(**{**fields, **changes})


def test_without_matplotlib_the_report_is_written_without_its_plot(tmp_path, monkeypatch) -> None:
    (tmp_path / PLOT).write_bytes(b"a plot of an earlier run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    write_report(_report(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([REPORT_JSON, REPORT_MD])
    assert VerifyReport.from_json((tmp_path / REPORT_JSON).read_text()) == _report()


def test_a_converted_record_without_calibration_keeps_only_its_keys() -> None:
    record = Provenance(version="0.1.0", command=None, format="modelopt",
                        converted_from=ConvertedFrom("/src", ("quark",)))
    assert json.loads(record.to_json()) == {"tool": "fp8kv", "version": "0.1.0", "command": None,
                                            "format": "modelopt", "layers": [],
                                            "converted_from": {"path": "/src", "conventions": ["quark"]}}
    assert Provenance.from_json(record.to_json()) == record


def test_a_report_without_held_out_checks_round_trips_and_leaves_optional_sections_out() -> None:
    report = _report()
    data = json.loads(report.to_json())
    assert not {"query", "generation_details", "fidelity"} & set(data)
    assert data["accuracy"] is None and data["layers"] == [] and data["digest"] == DIGEST.to_json()
    assert data["reasons"] == [{"level": "FAIL", "message": "held-out checks skipped", "engines": []}]
    assert VerifyReport.from_json(report.to_json()) == report


def test_non_finite_numbers_become_null_and_read_back_as_nan() -> None:
    accuracy = Accuracy(ppl_bf16=3.5, ppl_fp8=math.nan, ppl_fp8_unit=3.6, kl_mean=math.inf, kl_max=math.nan,
                        top1_agreement=0.5, kl_mean_unit=0.01, kl_max_unit=0.2, top1_agreement_unit=0.9)
    report = _report(held_out=HeldOut(accuracy=accuracy))
    written = json.loads(report.to_json())["accuracy"]
    assert (written["ppl_fp8"], written["kl_mean"], written["ppl_bf16"]) == (None, None, 3.5)
    back = VerifyReport.from_json(report.to_json()).held_out.accuracy
    assert math.isnan(back.ppl_fp8) and math.isnan(back.kl_mean) and back.ppl_bf16 == 3.5


def test_a_report_with_every_held_out_section_round_trips() -> None:
    held_out = HeldOut(
        text_source="t", num_samples=2, num_tokens=64,
        accuracy=Accuracy(3.5, 3.6, 3.7, 0.01, 0.2, 0.9, 0.02, 0.3, 0.8),
        generation=GenerationMatch(1.0, 0.75, None), readback=Readback(False, 2, ("layer 0: k_scale differs",)),
        layers=(LayerCheck(0, 300.0, 200.0, 0.0, 0.0, 0), LayerCheck(1, 470.5, 100.0, 1e-3, 0.0, 2)),
        runtime=RuntimeSummary("torch_xla.ragged_paged_attention (Pallas kernel)", True,
                               {"torch_xla.ragged_paged_attention (Pallas kernel)": 4}, "pallas-kernel", 0,
                               Compiles(warmup=12, timed=0)),
        engines=(EngineResult("vllm-tpu", 3.6, 0, 64, 0, 2, None, "vllm 0.32 tpu", "PASS"),
                 EngineResult("sglang", math.inf, 3, 64, 1, 2, 1, "sglang 0.5", "FAIL")),
        query=QueryCost(0.02, 0.4, 0.85, 3.9, 0.05, 0.01),
        generation_details=GenerationDetails(2, 8, 32, ((1, 2, 3), (4, 5, 6))),
        fidelity=Fidelity(1e-7, 2e-6, None, 5e-6, 2, 64),
    )
    report = _report(held_out=held_out)
    back = VerifyReport.from_json(report.to_json())
    assert back.to_json() == report.to_json()  # not ==: the inf perplexity reads back as NaN
    assert back.held_out.runtime == held_out.runtime and back.held_out.layers == held_out.layers and back.held_out.generation_details == held_out.generation_details
    assert back.held_out.fidelity == held_out.fidelity and back.held_out.readback == held_out.readback


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda d: d.pop("verdict"), "missing 'verdict'"),
    (lambda d: d.update(num_samples="4"), "'num_samples' is str, not int"),
    (lambda d: d.update(reasons=[{"level": "FAIL"}]), "missing 'message'"),
    (lambda d: d.pop("digest"), "has no valid checkpoint digest"),
])
def test_a_malformed_report_is_one_error_naming_the_file(edit, problem) -> None:
    data = json.loads(_report().to_json())
    edit(data)
    with pytest.raises(Fp8kvError, match=r"^dir/report\.json: .*" + re.escape(problem)):
        VerifyReport.from_json(json.dumps(data), "dir/report.json")
