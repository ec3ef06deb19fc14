"""verify of NVFP4 folders, per engine path: each runs the global scale its release's loader really holds, a path
whose scale is 6x off is a finding naming it, and its fix, typed in, gives a folder that path passes; an
fp8_k_nvfp4_v folder, which no release read serves, is judged on fp8kv's own arithmetic and says so."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8kv.checkpoint.kvscales import float32
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.cli import app
from fp8kv.engine_models import FP8_K_NVFP4_V_RELEASES, NVFP4_LOADERS
from fp8kv.hub.card import render_card
from fp8kv.inspection import inspect_checkpoint
from fp8kv.serving import NO_FP8_K_NVFP4_V_RELEASE, nvfp4_traits_of
from fp8kv.tools.factory import make_checkpoint
from fp8kv.verify.nvfp4 import OWN_FP8_K_NVFP4_V
from fp8kv.verify.nvfp4_report import nvfp4_lines, unit_family
from fp8kv.verify.report import HeldOut, VerifyReport, render_markdown
from fp8kv.verify.results import Nvfp4PathResult

VLLM_SM100, SGLANG_SM100, SGLANG_SM120 = "vllm-cuda 0.32.0 on sm100", "sglang 0.5.23 on sm100", "sglang 0.5.23 on sm120"
VLLM_4OVER6 = "vllm-cuda 0.32.0 on sm100 with --kv-cache-dtype nvfp4_4over6"
VLLM_FA2 = "vllm-cuda 0.32.0 on sm80/sm90/sm120"
NOT_LOADED = "tensorrt-llm commit ed53795 on sm100"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    texts = [f"Held-out record {i}: the paged cache stores keys and values for every token it has seen." * 2
             for i in range(4)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def calibrated(factory_checkpoint, corpus, tmp_path_factory) -> Path:
    """A qwen3 checkpoint (k_norm, RoPE; head_dim 16, one NVFP4 block) calibrated with --kv-dtype nvfp4."""
    out = tmp_path_factory.mktemp("nvfp4") / "out"
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("qwen3")), "--out", str(out), "--dataset", corpus,
                                      "--num-samples", "6", "--seq-len", "32", "--kv-dtype", "nvfp4", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def verify(folder: Path, heldout: Path, report: Path | None = None, *extra: str) -> VerifyReport:
    """`fp8kv verify --json` through the command line (report in `report`, else fp8kv's DIR/verify), read back as
    the report type."""
    where = ["--report", str(report)] if report is not None else []
    result = CliRunner().invoke(app, ["verify", str(folder), "--dataset", str(heldout), "--num-samples", "4",
                                      "--seq-len", "24", *where, *extra, "--json", "--quiet"])
    assert result.stdout.startswith("{"), result.output
    return VerifyReport.from_json(result.stdout)


def paths(report: VerifyReport) -> dict[str, Nvfp4PathResult]:
    assert report.held_out.nvfp4 is not None
    return {p.path: p for p in report.held_out.nvfp4.paths}


def typed_in(command: str) -> None:
    """Run a finding's fix as a user types it."""
    words = shlex.split(command)
    assert words[0] == "fp8kv"
    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, result.output


def fix_of(report: VerifyReport, path: str) -> str:
    (finding,) = [r for r in report.reasons if path in r.engines and " Fix: " in r.message]
    return finding.message.split(" Fix: ")[1].split(" (it then runs")[0]


@pytest.fixture(scope="module")
def own(calibrated, heldout) -> VerifyReport:
    return verify(calibrated, heldout)


def test_a_folder_fp8kv_wrote_passes_on_every_path_that_runs_it_as_stored(own, calibrated):
    stored = read_kv_scales(calibrated).scales
    assert own.held_out.nvfp4.convention == "modelopt" and own.held_out.nvfp4.divisor == 448.0
    assert own.held_out.accuracy is None and not own.held_out.engines  # no fp8 engine rows for an NVFP4 folder
    assert not [r for r in own.reasons if "TPU" in r.message]  # no TPU engine has an NVFP4 cache
    by_path = paths(own)
    assert list(by_path) == [loader.name for loader in NVFP4_LOADERS]
    traits = nvfp4_traits_of(own.checkpoint)
    assert traits.kv_only  # fp8kv quantizes no weights
    for loader in NVFP4_LOADERS:
        path = by_path[loader.name]
        assert path.read == ("fp8" if loader.fp8_dequant else "float32")
        # the global scale each path holds: the file's float32 value times its loader's factor, 1.0 unloaded (the
        # loader that reads them only beside quantized weights included)
        loads = loader.loads_for(traits)
        expected = [float32(stored.k[i][0] * loader.factor) if loads else 1.0 for i in sorted(stored.k)]
        assert list(path.k_scales) == expected
        if loads and loader.factor == 1.0:
            assert path.verdict == "PASS" and path.writes.fp8_read_over == 0, path
    assert by_path[VLLM_SM100].accuracy.kl_mean > own.held_out.nvfp4.fp8.kl_mean  # NVFP4 is coarser than fp8
    # vLLM's 4over6 write is a cache of its own: other block scales than nvfp4's, so other logits
    assert by_path[VLLM_4OVER6].accuracy.kl_mean != by_path[VLLM_SM100].accuracy.kl_mean
    # every held-out token written once per path: K and V, 2 layers x 2 KV heads x head_dim 16
    assert {p.writes.values for p in by_path.values()} == {2 * 2 * 2 * 16 * own.held_out.num_tokens}


def test_the_report_times_each_distinct_nvfp4_cache_once_naming_the_paths_it_runs(own):
    """One prefill timing per runner (bench/real_process.py prices each against a plain forward): the bf16 and fp8
    references together, then each NVFP4 cache (write, read, global scales) under the paths that run it."""
    prefills = [phase.removeprefix("prefill ") for phase in own.timings_s if phase.startswith("prefill ")]
    assert prefills[0] == "bf16 / fp8 / fp8 at 1.0"
    # 4 caches at the scales the paths hold (the unit family's tests) and 3 at 1.0: nvfp4 and 4over6 read in fp8,
    # nvfp4 read in float32; the path that loads no scales runs the first of those
    caches = prefills[1:]
    assert len(caches) == 7 and len({label.split(": ")[0] for label in caches}) == 3
    uses = [use for label in caches for use in label.split(": ", 1)[1].split("; ")]
    assert sorted(use for use in uses if not use.endswith(" at 1.0")) == sorted(loader.name for loader in NVFP4_LOADERS)
    traits = nvfp4_traits_of(own.checkpoint)
    assert sorted(use.removesuffix(" at 1.0") for use in uses if use.endswith(" at 1.0")) == sorted(
        loader.name for loader in NVFP4_LOADERS if loader.loads_for(traits))


def test_an_uncalibrated_cache_runs_global_scale_one_the_unit_figure_of_its_read(own):
    by_path = paths(own)
    unloaded, sm100 = by_path[NOT_LOADED], by_path[VLLM_SM100]
    assert set(unloaded.k_scales + unloaded.v_scales) == {1.0} and unloaded.accuracy.versus_unit == ()
    assert unloaded.accuracy.kl_mean == sm100.accuracy.kl_mean_unit  # the same fp8-read cache at 1.0
    (info,) = [r for r in own.reasons if r.engines == (NOT_LOADED,)]
    assert info.level == "INFO" and "does not load the scales: its NVFP4 cache runs global scale 1.0" in info.message
    # the same commit with TRTLLM_LOAD_KV_SCALES=1 loads scales only beside quantized weights: not this KV-only folder's
    (kv_only,) = [r for r in own.reasons if r.engines == (f"{NOT_LOADED} with TRTLLM_LOAD_KV_SCALES=1",)]
    assert kv_only.level == "INFO" and kv_only.message.startswith(
        f"{NOT_LOADED} with TRTLLM_LOAD_KV_SCALES=1 does not load the scales of a KV-only folder (only beside quantized "
        "weights): its NVFP4 cache runs global scale 1.0")
    assert {d.measure for d in sm100.accuracy.versus_unit} == {"kl_mean", "top1_agreement", "nll"}


def test_paths_sharing_a_cache_are_one_test_of_the_family_and_too_few_sequences_are_said(own):
    """The calibrated-vs-unit family under Holm's procedure, as for fp8 engines: one test per distinct cache (read,
    global scales, write), the unloaded path none; 4 sequences cannot reach Holm's first bound over 4 tests (2^-4 >
    5 % / 4), and the report says how many would."""
    traits = nvfp4_traits_of(own.checkpoint)
    (trt,) = [loader.name for loader in NVFP4_LOADERS if loader.engine == "tensorrt-llm" and loader.loads_for(traits)]
    family = unit_family(list(paths(own).values()))
    assert sorted(c.engines for c in family) == sorted([(VLLM_SM100, trt), (VLLM_4OVER6,), (SGLANG_SM100,),
                                                        (VLLM_FA2, SGLANG_SM120)])
    notes = [line for line in nvfp4_lines(own.held_out.nvfp4, own.thresholds) if line.startswith("note: ")]
    assert len(notes) == 4 and all("4 held-out sequences are too few to compare these scales with unit scales (this "
                                   "many comparisons at this false-alarm rate need at least 7" in n for n in notes)


def test_sglang_sm100_x6_on_amax_448_is_a_finding_whose_convert_passes_that_path(own, calibrated, heldout, tmp_path):
    (finding,) = [r for r in own.reasons if r.engines == (SGLANG_SM100,)]
    assert finding.level == "WARN" and paths(own)[SGLANG_SM100].verdict == "WARN"
    assert finding.message.startswith(f"{SGLANG_SM100} runs the stored modelopt global scale x6 = amax / 74.6667, "
                                      "6x larger than amax / 448: block scales top out at 12.4 / headroom")
    fix = fix_of(own, SGLANG_SM100)
    assert fix == f"fp8kv convert {calibrated} --to modelopt-pre-0.42 --out {calibrated}-modelopt-pre-0.42"
    typed_in(fix)
    fixed = verify(Path(f"{calibrated}-modelopt-pre-0.42"), heldout, tmp_path / "fixed")
    assert paths(fixed)[SGLANG_SM100].verdict == "PASS"
    assert not [r for r in fixed.reasons if SGLANG_SM100 in r.engines]
    # the fixed folder runs on SGLang sm100 what the original runs on vLLM sm100, within one float32 step
    for ours, theirs in zip(paths(fixed)[SGLANG_SM100].k_scales, paths(own)[VLLM_SM100].k_scales):
        assert abs(ours - theirs) <= 2 ** -23 * theirs


def test_an_auto_round_folder_overflows_vllms_sm100_read_and_its_convert_passes_it(calibrated, heldout, tmp_path):
    auto_round = tmp_path / "ar"
    typed_in(f"fp8kv convert {calibrated} --to auto-round --out {auto_round}")
    report = verify(auto_round, heldout, tmp_path / "r")
    by_path = paths(report)
    assert report.verdict == "FAIL" and by_path[VLLM_SM100].verdict == "FAIL"
    assert by_path[VLLM_SM100].writes.fp8_read_over > 0
    # vLLM's 4over6 write picks each block's scale from two targets, neither of which keeps 6 x 448 in range
    assert by_path[VLLM_4OVER6].verdict == "FAIL" and by_path[VLLM_4OVER6].writes.fp8_read_over > 0
    assert by_path[SGLANG_SM100].verdict == "PASS" and by_path[SGLANG_SM100].writes.fp8_read_over == 0  # x6: 448
    # read in float32 (vLLM's fa2 path reads blocks in bf16, exactly), block scales up to 448 are in range: the same
    # products an fp8 read could not hold are held
    for path in (SGLANG_SM120, VLLM_FA2):
        assert by_path[path].verdict == "PASS" and by_path[path].writes.fp8_read_over > 0
        assert f"| {path} | PASS | float32 |" in render_markdown(report)
    assert by_path[VLLM_FA2].writes == by_path[SGLANG_SM120].writes  # one cache: the same write at the same scale
    assert "(read in float32: held)" in render_markdown(report)
    for path in (VLLM_SM100, VLLM_4OVER6):
        (finding,) = [r for r in report.reasons if r.engines == (path,) and r.level == "FAIL"]
        assert finding.message.startswith(f"{path} runs the stored auto-round global scale as stored = amax / 2688: "
                                          "its e4m3 dequantization overflows wherever a block's max passes amax x "
                                          f"headroom / 6, {by_path[path].writes.fp8_read_over} values past 448 on the "
                                          "held-out text")
        assert fix_of(report, path) == f"fp8kv convert {auto_round} --to modelopt --out {auto_round}-modelopt"
    typed_in(fix_of(report, VLLM_4OVER6))
    fixed = paths(verify(Path(f"{auto_round}-modelopt"), heldout, tmp_path / "fixed"))
    for path in (VLLM_SM100, VLLM_4OVER6):
        assert fixed[path].verdict == "PASS" and fixed[path].writes.fp8_read_over == 0


def _modelopt_export(folder: Path, base: Path, calibrated: Path, version: str, algo: str) -> Path:
    """`base` with `calibrated`'s scales over 6 under ModelOpt's names (amax / 2688, as ModelOpt before 0.42 and
    auto-round store them) and an `hf_quant_config.json` naming ModelOpt `version` and kv_cache_quant_algo `algo`."""
    shutil.copytree(base, folder)
    stored = read_kv_scales(calibrated).scales
    weights = load_file(folder / "model.safetensors")
    for layer in stored.k:
        for name, side in (("k_proj.k_scale", stored.k), ("v_proj.v_scale", stored.v)):
            weights[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(float32(side[layer][0] / 6))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": version},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": algo}}))
    return folder


def test_a_modelopt_041_export_is_read_as_amax_2688_and_judged_like_auto_round(calibrated, factory_checkpoint, heldout,
                                                                                tmp_path):
    """ModelOpt's own KV-only export before 0.42: its producer's version says amax / 2688."""
    folder = _modelopt_export(tmp_path / "modelopt-041", factory_checkpoint("qwen3"), calibrated, "0.41.0", "NVFP4")
    report = verify(folder, heldout, tmp_path / "r")
    assert (report.held_out.nvfp4.convention, report.held_out.nvfp4.divisor) == ("modelopt-pre-0.42", 2688.0)
    by_path = paths(report)
    assert by_path[VLLM_SM100].verdict == "FAIL" and by_path[VLLM_SM100].writes.fp8_read_over > 0
    assert by_path[SGLANG_SM100].verdict == "PASS"
    fix = fix_of(report, VLLM_SM100)
    assert fix == f"fp8kv convert {folder} --to modelopt --out {folder}-modelopt"
    typed_in(fix)
    assert paths(verify(Path(f"{folder}-modelopt"), heldout, tmp_path / "fixed"))[VLLM_SM100].verdict == "PASS"


def test_the_kl_bound_fails_each_path_that_loads_the_scales_on_its_own_figure(own, calibrated, heldout, tmp_path):
    bound = own.held_out.nvfp4.fp8.kl_mean  # below every NVFP4 path's KL, above none of the fp8 cache's
    report = verify(calibrated, heldout, tmp_path / "r", "--max-kl-mean", f"{bound:.17g}")
    for path in paths(report).values():
        named = [r.message for r in report.reasons if r.engines == (path.path,) and "exceeds the bound" in r.message]
        assert named == ([f"{path.path}: mean KL of its NVFP4 cache to the bf16 cache {path.accuracy.kl_mean:.4g} "
                          f"nats exceeds the bound {bound:g}"] if path.loads else [])
        assert path.verdict == ("FAIL" if path.loads else "PASS")


def test_the_report_and_the_card_show_each_path_and_an_fp8_report_has_no_nvfp4_key(own, calibrated):
    assert VerifyReport.from_json(own.to_json()) == own
    row = f"| {VLLM_SM100} | PASS | fp8 | as stored: "
    for text in (render_markdown(own), render_card(calibrated)):
        assert "## NVFP4 cache per engine path" in text and row in text
    assert f"**Verdict: {own.verdict}**" in render_card(calibrated)
    # the per-layer fp8 plot would show nothing of an NVFP4 cache: its figures are each path's
    assert (calibrated / "verify" / "report.md").is_file() and not (calibrated / "verify" / "scales.png").exists()
    assert "nvfp4" in own.to_dict() and "nvfp4" not in replace(own, held_out=HeldOut()).to_dict()
    # a report written before fp8_k_nvfp4_v was judged has neither key: nvfp4 K and V, no fp8 K clamped
    earlier = own.to_dict()
    del earlier["nvfp4"]["kv_dtype"]
    for path in earlier["nvfp4"]["paths"]:
        del path["writes"]["fp8_k_clamped"]
    assert VerifyReport.from_json(json.dumps(earlier)) == own


def test_an_xla_device_is_refused_in_one_line_before_any_model_runs(calibrated, heldout, tmp_path):
    result = CliRunner().invoke(app, ["verify", str(calibrated), "--dataset", str(heldout), "--device", "xla-cpu",
                                      "--report", str(tmp_path / "r"), "--quiet"])
    assert result.exit_code == 4
    assert result.output == ("fp8kv: error: --device xla-cpu: an NVFP4 cache runs on cpu or cuda here (no TPU engine "
                             "has one); pass --device cpu or --device cuda\n")


@pytest.fixture(scope="module")
def mixed_calibration(factory_checkpoint, corpus, tmp_path_factory) -> tuple[Path, str]:
    """The qwen3 checkpoint calibrated with --kv-dtype fp8_k_nvfp4_v, and what calibrate printed."""
    out = tmp_path_factory.mktemp("mixed") / "out"
    result = CliRunner().invoke(app, ["calibrate", str(factory_checkpoint("qwen3")), "--out", str(out), "--dataset", corpus,
                                      "--num-samples", "6", "--seq-len", "32", "--kv-dtype", "fp8_k_nvfp4_v", "--quiet"])
    assert result.exit_code == 0, result.output
    return out, result.stdout


def test_an_fp8_k_nvfp4_v_folder_is_judged_on_fp8kvs_own_arithmetic_naming_no_release(mixed_calibration, heldout):
    folder, printed = mixed_calibration
    report = verify(folder, heldout)
    stored = read_kv_scales(folder).scales
    (path,) = report.held_out.nvfp4.paths
    assert (report.held_out.nvfp4.kv_dtype, path.path, path.read) == ("fp8_k_nvfp4_v", OWN_FP8_K_NVFP4_V.name, "float32")
    assert list(path.k_scales) == [stored.k[i][0] for i in sorted(stored.k)]  # the stored scales, as they are
    assert path.verdict == report.verdict == "PASS" and path.writes.values == 2 * 2 * 2 * 16 * report.held_out.num_tokens
    assert path.writes.fp8_read_over == 0  # K is fp8, V is read in float32
    assert path.versus_fp8.kl_mean > 0  # V is NVFP4, K the fp8 cache's own bytes
    (info,) = [r for r in report.reasons if r.engines == (path.path,)]
    assert info.level == "INFO" and info.message.startswith(
        f"{NO_FP8_K_NVFP4_V_RELEASE}: vllm-cuda 0.32.0 and sglang 0.5.23 run another cache with this folder")
    assert [release.name for release in FP8_K_NVFP4_V_RELEASES] == ["vllm-cuda 0.32.0", "sglang 0.5.23"]
    row = f"| {path.path} | PASS | float32 | as stored: "
    assert row in render_markdown(report) and f"{path.writes.clipped_values} V, 0 K at ±448 |" in render_markdown(report)
    card = render_card(folder)
    assert row in card and f"## How to serve\n\n{NO_FP8_K_NVFP4_V_RELEASE}: each release above" in card
    # calibrate's closing lines say what each release read runs instead, and point at this verify
    assert "the stored V global scale is amax x 1.25 / 448; what each release read does with it" in printed
    assert "  sglang 0.5.23: no fp8 K / nvfp4 V cache; runs a cache in the model's dtype" in printed
    assert f"{NO_FP8_K_NVFP4_V_RELEASE}: verify judges this folder on fp8kv's own arithmetic\n" in printed
    assert "serve it with" not in printed and printed.endswith(f"next: fp8kv verify {folder} --dataset generated\n")


def test_a_modelopt_fp8_k_nvfp4_v_export_6x_too_small_is_found_by_its_fp8_k(mixed_calibration, factory_checkpoint,
                                                                            heldout, tmp_path):
    """A ModelOpt FP8_K_NVFP4_V export (no fp8kv record) storing amax / 2688: V's NVFP4 holds it (block scales up to
    448, read in float32), but the fp8 K clamps every value past a sixth of amax x headroom."""
    folder = _modelopt_export(tmp_path / "modelopt-mixed", factory_checkpoint("qwen3"), mixed_calibration[0],
                              "0.45.0", "FP8_K_NVFP4_V")
    report = verify(folder, heldout, tmp_path / "r")
    (path,) = report.held_out.nvfp4.paths
    assert path.path == OWN_FP8_K_NVFP4_V.name and path.verdict != "PASS" and report.verdict != "PASS"
    share = path.writes.fp8_k_clamped / (path.writes.values // 2)
    (finding,) = [r for r in report.reasons if r.engines == (path.path,) and r.level == "WARN"]
    assert finding.message.startswith(f"{path.path}: {share:.3%} of K values clamped at ±448 in its fp8 K (WARN above")
    # V's block scales stay within e4m3 (amax / 2688 was ModelOpt's NVFP4 scale); K's fp8 is what clamps
    assert share > 0.1 and path.writes.saturated_scales == 0


def test_a_release_that_refuses_the_models_head_dim_is_named_and_not_judged(tmp_path, corpus, heldout):
    """vLLM 0.32.0 will not start its fa2 NVFP4 cache at head_size 64: calibrate, inspect and the card say so for such
    a model, and verify judges every other path but not that one."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["calibrate", str(make_checkpoint("qwen3", tmp_path / "src", head_dim=64)),
                                      "--out", str(out), "--dataset", corpus, "--num-samples", "4", "--seq-len", "16",
                                      "--kv-dtype", "nvfp4"])
    assert result.exit_code == 0, result.output
    refused = (f"{VLLM_FA2}: does not start this model's NVFP4 cache: fa2 prefill misreads an NVFP4 KV cache at "
               "head_size 64 (this model's head_dim: 64)")
    assert f"  {refused} (" in result.stdout
    assert f"  {SGLANG_SM120}: as stored -> runs" in result.stdout  # the other rows as for any model
    (meaning,) = inspect_checkpoint(out).nvfp4_meanings
    assert [line for line in meaning.runs if line.startswith(VLLM_FA2)] == [line for line in result.stdout.split("\n  ")
                                                                           if line.startswith(VLLM_FA2)]
    assert f"- {refused} (" in render_card(out)

    report = verify(out, heldout)
    assert VLLM_FA2 not in paths(report) and {SGLANG_SM120, VLLM_SM100} <= set(paths(report))
    (note,) = [r for r in report.reasons if VLLM_FA2 in r.engines]
    assert note.level == "INFO" and "head_size 64" in note.message and "not judged" in note.message
