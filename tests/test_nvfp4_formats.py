"""NVFP4 KV-cache scales: calibrate writes ModelOpt's files exactly, every convention reads back with what it means,
convert applies the factor, and a bad or mixed folder is one error naming its file."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8kv import __version__
from fp8kv.calibrate.scales import scale_from_amax
from fp8kv.checkpoint.convert import convert_checkpoint
from fp8kv.checkpoint.kvscales import KVScales, float32
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.cli import app
from fp8kv.engine_models import NVFP4_LOADERS
from fp8kv.errors import Fp8kvError
from fp8kv.hub.card import render_card
from fp8kv.inspection import inspect_checkpoint
from fp8kv.serving import nvfp4_lines, nvfp4_traits_of
from fp8kv.tools.factory import make_checkpoint

ATTN = "model.layers.{}.self_attn."
# amax / 448 of a few amaxes, as float32 (powers of two times 3 divide by 6 exactly)
K = {0: 0.046875, 1: 0.0234375}
V = {0: 0.1875, 1: 0.09375}
SGLANG_SM100 = "sglang 0.5.23 on sm100: x6 (a stored 1.0 stays 1.0) -> runs 6 x amax x {h} / {div} = amax x {h} / {ran}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, str]:
    """A qwen3 checkpoint (k_norm, RoPE) calibrated with --kv-dtype nvfp4 through the command line, and its output."""
    root = tmp_path_factory.mktemp("calibrated")
    src = make_checkpoint("qwen3", root / "src")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of calibration text"}) + "\n" for i in range(4)))
    args = ["calibrate", str(src), "--out", str(root / "out"), "--dataset", str(data), "--num-samples", "4",
            "--seq-len", "16", "--kv-dtype", "nvfp4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return root / "out", result.stdout


def _with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], hf_quant: dict | None = None,
          qc: dict | None = None) -> Path:
    """A copy of `src` holding `tensors` in its model.safetensors, with hf_quant_config.json and config.json's
    quantization_config as a tool writes them."""
    shutil.copytree(src, dst)
    save_file({**load_file(dst / "model.safetensors"), **tensors}, dst / "model.safetensors", metadata={"format": "pt"})
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if qc is not None:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dst


def modelopt(base: Path, dst: Path, version: str | None, algo: str = "NVFP4") -> Path:
    """ModelOpt's NVFP4 export: 0-dim float32 k_proj.k_scale / v_proj.v_scale, kv_cache_quant_algo, its producer."""
    tensors = {ATTN.format(i) + n: torch.tensor(s[i])
               for i in K for n, s in (("k_proj.k_scale", K), ("v_proj.v_scale", V))}
    meta: dict = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": algo}}  # a KV-only export
    if version is not None:
        meta["producer"] = {"name": "modelopt", "version": version}
    return _with(base, dst, tensors, hf_quant=meta)


def auto_round(base: Path, dst: Path) -> Path:
    """auto-round's export (llm-compressor's format): self_attn.k_scale / v_scale and a 4-bit kv_cache_scheme."""
    tensors = {ATTN.format(i) + n: torch.tensor([s[i] / 6]) for i in K for n, s in (("k_scale", K), ("v_scale", V))}
    qc = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
          "kv_cache_scheme": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                              "dynamic": False, "symmetric": True}}
    return _with(base, dst, tensors, qc=qc)


def test_calibrate_writes_modelopts_nvfp4_files_exactly(calibrated):
    out, _ = calibrated
    assert json.loads((out / "hf_quant_config.json").read_text()) == {
        "producer": {"name": "fp8kv", "version": __version__, "nvfp4_convention": "modelopt"},
        "quant_method": "modelopt",
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4", "exclude_modules": ["*"]}}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    record = json.loads((out / "fp8kv.json").read_text())
    assert (record["kv_dtype"], record["fp8_max"], record["format"]) == ("nvfp4", 448.0, "modelopt")
    written = load_file(out / "kv_scales.safetensors")
    assert sorted(written) == sorted(ATTN.format(i) + n for i in (0, 1) for n in ("k_proj.k_scale", "v_proj.v_scale"))
    for row in record["layers"]:
        for side, name in (("k", "k_proj.k_scale"), ("v", "v_proj.v_scale")):
            stored = written[ATTN.format(row["layer"]) + name]
            assert stored.shape == () and stored.dtype == torch.float32
            # amax x headroom / 448 from the observed amax, bit for bit (the one formula, its nextafter included)
            expected = scale_from_amax(torch.tensor(row[f"{side}_amax"]), "fp8_e4m3", record["headroom"])
            assert stored.item() == expected.item() == row[f"{side}_scale"]
            assert abs(stored.item() - row[f"{side}_amax"] * record["headroom"] / 448) <= 2 ** -23 * stored.item()


def test_calibrate_says_what_each_release_runs_and_how_to_serve(calibrated):
    out, stdout = calibrated
    assert "the stored K and V global scale is amax x 1.25 / 448" in stdout
    assert "vllm-cuda 0.32.0 on sm100: as stored -> runs amax x 1.25 / 448; block scales up to 59.73" in stdout
    assert SGLANG_SM100.format(h="1.25", div="448", ran="74.67") in stdout
    assert "fp8kv convert --to modelopt-pre-0.42 gives it amax / 448" in stdout
    assert "sglang 0.5.23 on sm120: as stored -> runs amax x 1.25 / 448" in stdout
    assert "vllm-cuda 0.32.0 on sm80/sm90/sm120: as stored -> runs amax x 1.25 / 448" in stdout  # head_dim 16: starts
    assert f"  vllm serve {out} --kv-cache-dtype nvfp4\n  vllm serve {out} --kv-cache-dtype nvfp4_4over6\n" in stdout
    assert "vllm-cuda 0.32.0 on sm100 with --kv-cache-dtype nvfp4_4over6: as stored -> runs amax x 1.25 / 448" in stdout
    assert f"  python -m sglang.launch_server --model-path {out} --kv-cache-dtype nvfp4\n" in stdout
    assert stdout.endswith(f"next: fp8kv verify {out} --dataset generated\n")


@pytest.mark.parametrize(("version", "conventions", "why"), [
    ("0.45.0", ("modelopt",), "hf_quant_config.json producer ModelOpt 0.45.0"),
    ("0.42.0rc0", ("modelopt",), "hf_quant_config.json producer ModelOpt 0.42.0rc0"),
    ("0.41.0", ("modelopt-pre-0.42",), "hf_quant_config.json producer ModelOpt 0.41.0"),
    ("0.42.0dev", ("modelopt", "modelopt-pre-0.42"),
     "hf_quant_config.json producer ModelOpt 0.42.0dev: a build on either side of the change to amax / 448"),
    (None, ("modelopt", "modelopt-pre-0.42"),
     "hf_quant_config.json names no producer; ModelOpt files say no divisor themselves"),
])
def test_modelopt_files_read_by_the_producers_version(base, tmp_path, version, conventions, why):
    readout = read_kv_scales(modelopt(base, tmp_path / "m", version))
    assert (readout.kv_dtype, readout.nvfp4.conventions, readout.nvfp4.why) == ("nvfp4", conventions, why)
    assert {i: readout.scales.values(i) for i in K} == {i: ([K[i]], [V[i]]) for i in K}
    report = inspect_checkpoint(tmp_path / "m")
    assert [m.convention for m in report.nvfp4_meanings] == list(conventions)
    runs = {m.convention: m.runs for m in report.nvfp4_meanings}
    if "modelopt" in runs:  # the factor each reading gives SGLang on sm100
        assert _sglang_sm100(runs["modelopt"]).startswith(SGLANG_SM100.format(h="h", div="448", ran="74.67"))
    if "modelopt-pre-0.42" in runs:
        expected = SGLANG_SM100.format(h="h", div="2688", ran="448") + "; block scales up"
        assert _sglang_sm100(runs["modelopt-pre-0.42"]).startswith(expected)


def _sglang_sm100(lines: tuple[str, ...]) -> str:
    (line,) = [line for line in lines if line.startswith("sglang 0.5.23 on sm100:")]
    return line


def test_auto_round_reads_as_amax_over_2688(base, tmp_path):
    report = inspect_checkpoint(auto_round(base, tmp_path / "a"))
    assert report.conventions == ("compressed-tensors",) and report.kv_dtype == "nvfp4"
    assert report.nvfp4.conventions == ("auto-round",)
    (meaning,) = report.nvfp4_meanings
    assert (meaning.divisor, meaning.runs[0]) == (2688.0, (
        "vllm-cuda 0.32.0 on sm100: as stored -> runs amax x h / 2688; its e4m3 dequantization overflows: e2m1 code "
        "x block scale reaches 2688/h, past 448; fp8kv convert --to modelopt gives it amax / 448 (read from source)"))
    assert report.to_dict()["nvfp4"] == {"kv_dtype": "nvfp4", "conventions": ["auto-round"],
                                         "why": "config.json's 4-bit compressed-tensors kv_cache_scheme"}


def test_convert_applies_the_factor_and_round_trips(base, tmp_path):
    start = modelopt(base, tmp_path / "m", "0.45.0")
    to_auto = convert_checkpoint(start, tmp_path / "auto", "auto-round")
    tensors = load_file(to_auto / "kv_scales.safetensors")
    assert {name: t.item() for name, t in tensors.items()} == {
        ATTN.format(i) + n: s[i] / 6 for i in K for n, s in (("k_scale", K), ("v_scale", V))}
    qc = json.loads((to_auto / "config.json").read_text())["compression_config"]
    assert qc["kv_cache_scheme"]["num_bits"] == 4 and not (to_auto / "hf_quant_config.json").exists()
    assert read_kv_scales(to_auto).nvfp4.conventions == ("auto-round",)
    to_old = convert_checkpoint(to_auto, tmp_path / "old", "modelopt-pre-0.42")
    assert read_kv_scales(to_old).nvfp4.conventions == ("modelopt-pre-0.42",)  # fp8kv.json says which
    back = read_kv_scales(convert_checkpoint(to_old, tmp_path / "back", "modelopt"))
    assert back.nvfp4.conventions == ("modelopt",)
    assert {i: back.scales.values(i) for i in K} == {i: ([K[i]], [V[i]]) for i in K}


def test_convert_is_within_one_float32_step_for_any_value(base, tmp_path):
    k, v = {0: 0.0123456, 1: 0.0234567}, {0: 0.0345678, 1: 0.0456789}
    scales = KVScales.from_floats(k, v, kv_dtype="nvfp4")
    start = write_checkpoint(base, tmp_path / "start", scales, convention="modelopt")  # no fp8kv.json
    assert read_kv_scales(start).nvfp4.why == "hf_quant_config.json producer fp8kv, nvfp4_convention modelopt"
    there = read_kv_scales(convert_checkpoint(start, tmp_path / "auto", "auto-round")).scales
    assert there.k[0] == (float32(float32(k[0]) * 448 / 2688),)  # one rounding, from the exact product
    back = read_kv_scales(convert_checkpoint(tmp_path / "auto", tmp_path / "back", "modelopt")).scales
    for layer in scales.layers:
        for was, now in zip(scales.k[layer] + scales.v[layer], back.k[layer] + back.v[layer]):
            assert abs(now - was) <= 2 ** -23 * was


def test_a_calibrated_folder_converted_keeps_a_record_that_matches_its_file(calibrated, tmp_path):
    out, _ = calibrated
    auto = convert_checkpoint(out, tmp_path / "auto", "auto-round")
    record = json.loads((auto / "fp8kv.json").read_text())
    held = read_kv_scales(auto).scales
    assert record["fp8_max"] == 2688.0
    assert [(row["k_scale"], row["v_scale"]) for row in record["layers"]] == [
        (held.k[i][0], held.v[i][0]) for i in held.layers]
    assert not [w for w in inspect_checkpoint(auto).warnings if "recorded" in w]


def test_ambiguous_files_need_from(base, tmp_path):
    src = modelopt(base, tmp_path / "m", None)
    with pytest.raises(Fp8kvError) as caught:
        convert_checkpoint(src, tmp_path / "o", "auto-round")
    assert str(caught.value) == (
        f"{src}: hf_quant_config.json names no producer; ModelOpt files say no divisor themselves, so its NVFP4 "
        "scales may be amax / 448 or amax / 2688; pass --from modelopt or --from modelopt-pre-0.42")
    written = convert_checkpoint(src, tmp_path / "o", "auto-round", source_convention="modelopt-pre-0.42")
    assert read_kv_scales(written).scales.k[0] == (K[0],)  # 2688 to 2688: no factor
    with pytest.raises(Fp8kvError, match=r"--from auto-round contradicts its files"):
        convert_checkpoint(src, tmp_path / "o2", "modelopt", source_convention="auto-round")


@pytest.mark.parametrize(("target", "message"), [
    ("quark", "nvfp4 global scales are written as modelopt, modelopt-pre-0.42, auto-round, not 'quark'"),
    ("compressed-tensors",
     "nvfp4 global scales are written as modelopt, modelopt-pre-0.42, auto-round, not 'compressed-tensors'"),
])
def test_nvfp4_scales_are_not_written_as_fp8_conventions(base, tmp_path, target, message):
    with pytest.raises(Fp8kvError) as caught:
        convert_checkpoint(modelopt(base, tmp_path / "m", "0.45.0"), tmp_path / "o", target)
    assert str(caught.value) == message


def test_a_calibrated_nvfp4_folder_is_refused_an_fp8_convention_in_one_line(calibrated, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(calibrated[0]), "--to", "quark", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert result.output == ("fp8kv: error: nvfp4 global scales are written as modelopt, modelopt-pre-0.42, "
                             "auto-round, not 'quark'\n")


def test_fp8_scales_are_not_written_as_nvfp4_conventions(base, tmp_path):
    fp8 = write_checkpoint(base, tmp_path / "fp8", KVScales.from_floats(K, V))
    with pytest.raises(Fp8kvError) as caught:
        convert_checkpoint(fp8, tmp_path / "o", "auto-round")
    assert str(caught.value) == ("auto-round is an NVFP4 convention; these scales are fp8_e4m3: use "
                                 "compressed-tensors, modelopt, quark or vllm-json")


def test_a_mixed_or_unknown_declaration_is_one_error_naming_the_file(base, tmp_path):
    mixed = auto_round(base, tmp_path / "mixed")
    (mixed / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "NVFP4"}}))
    with pytest.raises(Fp8kvError) as caught:
        read_kv_scales(mixed)
    assert str(caught.value) == (
        f"{mixed}: hf_quant_config.json declares a ModelOpt NVFP4 KV cache and config.json a 4-bit "
        "compressed-tensors kv_cache_scheme (auto-round's); keep one (fp8kv convert writes one)")
    affine = modelopt(base, tmp_path / "affine", "0.45.0", algo="NVFP4_AFFINE")
    result = CliRunner().invoke(app, ["inspect", str(affine)])
    assert result.exit_code != 0
    assert result.output == (f"fp8kv: error: {affine}/hf_quant_config.json: kv_cache_quant_algo 'NVFP4_AFFINE' is "
                             "an NVFP4 variant fp8kv does not read; it reads NVFP4 and FP8_K_NVFP4_V\n")


def test_fp8_k_nvfp4_v_is_modelopts_mixed_algo(base, tmp_path):
    scales = KVScales.from_floats(K, V, kv_dtype="fp8_k_nvfp4_v")
    out = write_checkpoint(base, tmp_path / "mixed", scales, convention="modelopt")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == \
        "FP8_K_NVFP4_V"
    readout = read_kv_scales(out)
    assert (readout.kv_dtype, readout.nvfp4.conventions) == ("fp8_k_nvfp4_v", ("modelopt",))
    with pytest.raises(Fp8kvError, match=r"fp8_k_nvfp4_v \(fp8 K, nvfp4 V\) is written as modelopt only"):
        convert_checkpoint(out, tmp_path / "o", "auto-round")
    (meaning,) = inspect_checkpoint(out).nvfp4_meanings  # no release read has the mixed cache: what each runs
    assert meaning.runs == (
        "vllm-cuda 0.32.0: no fp8 K / nvfp4 V cache; runs a cache in the model's dtype: its ModelOpt reader knows "
        "kv_cache_quant_algo FP8 and NVFP4 only and takes any other as --kv-cache-dtype auto, and --kv-cache-dtype "
        "offers no fp8 K with nvfp4 V (read from its published package)",
        "sglang 0.5.23: no fp8 K / nvfp4 V cache; runs a cache in the model's dtype under --kv-cache-dtype auto (only "
        "kv_cache_quant_algo FP8 picks an fp8 cache), and --kv-cache-dtype offers no fp8 K with nvfp4 V (read from its "
        "published package)")


@pytest.mark.parametrize(("extra", "message"), [
    (["--format", "compressed-tensors"],
     "nvfp4 global scales are written as modelopt, modelopt-pre-0.42, auto-round, not 'compressed-tensors'"),
    (["--strategy", "mse"], "--strategy mse minimises the fp8 cast's error; nvfp4's error is set per block of 16 "
                            "values, which it does not model: use amax or percentile:P"),
    (["--per-head"], "nvfp4 takes one global scale per layer and side; drop --per-head"),
])
def test_calibrate_refuses_what_nvfp4_cannot_carry_before_any_work(tmp_path, extra, message):
    result = CliRunner().invoke(app, ["calibrate", "bundled", "--out", str(tmp_path / "o"), "--kv-dtype", "nvfp4",
                                      *extra])
    assert result.exit_code != 0
    assert result.output == f"fp8kv: error: {message}\n"


def test_the_nvfp4_loader_rows_are_the_releases_read_and_run():
    rows = {loader.name: (loader.loads, loader.factor, loader.keeps_unit, loader.fp8_dequant, loader.evidence,
                          loader.write) for loader in NVFP4_LOADERS}
    assert rows == {
        "vllm-cuda 0.32.0 on sm100": (True, 1.0, False, True, "read", "nvfp4"),
        "vllm-cuda 0.32.0 on sm100 with --kv-cache-dtype nvfp4_4over6": (True, 1.0, False, True, "read", "nvfp4_4over6"),
        "vllm-cuda 0.32.0 on sm80/sm90/sm120": (True, 1.0, False, False, "read", "nvfp4"),
        "sglang 0.5.23 on sm100": (True, 6.0, True, True, "run", "nvfp4"),
        "sglang 0.5.23 on sm120": (True, 1.0, False, False, "run", "nvfp4"),
        "tensorrt-llm commit 00bbf71 on sm100": (True, 1.0, False, True, "read", "nvfp4"),
        "tensorrt-llm commit ed53795 on sm100": (False, 1.0, False, True, "read", "nvfp4"),
        "tensorrt-llm commit ed53795 on sm100 with TRTLLM_LOAD_KV_SCALES=1": (True, 6.0, False, True, "read", "nvfp4"),
    }
    for loader in NVFP4_LOADERS:  # vLLM names its cache write on the command line
        if loader.engine == "vllm-cuda":
            words = loader.serve.split()
            assert words[words.index("--kv-cache-dtype") + 1] == loader.write, loader.name


def test_the_card_states_the_nvfp4_meaning(calibrated):
    out, _ = calibrated
    card = render_card(out)
    assert "## KV-cache scales (NVFP4)" in card and "`amax × 1.25 / 448` (modelopt" in card
    assert "- " + SGLANG_SM100.format(h="1.25", div="448", ran="74.67") in card
    assert f"vllm serve {out.name} --kv-cache-dtype nvfp4" in card
    assert "fp8(clamp(" not in card  # the fp8 cast does not describe this cache


def test_verify_refuses_in_one_line_a_modelopt_folder_without_its_divisor_but_takes_fp8_k_nvfp4_v(base, tmp_path):
    """Before any model runs: each path's global scale depends on the divisor. A mixed cache is modelled now: such a
    folder goes on to the held-out text verify needs (tests/test_verify_nvfp4.py runs it)."""
    unknown = modelopt(base, tmp_path / "m", None)
    result = CliRunner().invoke(app, ["verify", str(unknown), "--quiet", "--report", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert result.output == (f"fp8kv: error: {unknown}: its files do not say whether the global scales are stored "
                             "as modelopt or modelopt-pre-0.42 (hf_quant_config.json names no producer; ModelOpt files "
                             "say no divisor themselves), and each path's scale depends on it; fp8kv inspect shows "
                             "both readings\n")
    mixed = modelopt(base, tmp_path / "x", "0.45.0", algo="FP8_K_NVFP4_V")
    result = CliRunner().invoke(app, ["verify", str(mixed), "--quiet", "--report", str(tmp_path / "r")])
    assert result.output.startswith(f"fp8kv: error: {mixed}: verify's default held-out text is the bundled model's "
                                    "corpus, which says nothing about this model; pass --dataset")


def test_load_check_refuses_nvfp4_before_running_an_engine(base, tmp_path):
    folder = modelopt(base, tmp_path / "m", "0.45.0")
    result = CliRunner().invoke(app, ["load-check", str(folder), "--engine", "sglang", "--python", "/nonexistent"])
    assert result.exit_code != 0
    assert result.output == (f"fp8kv: error: {folder}: holds nvfp4 scales, and load-check loads fp8 caches only; "
                             "probes/sglang_nvfp4_loader.py runs SGLang's NVFP4 loader (docs/nvfp4.md)\n")


def test_convert_through_the_command_line_takes_from(base, tmp_path):
    src = modelopt(base, tmp_path / "m", None)
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["convert", str(src), "--to", "modelopt", "--out", str(out),
                                      "--from", "modelopt-pre-0.42"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out} (modelopt)\n"
    assert read_kv_scales(out).scales.k == {i: (float32(K[i] * 6),) for i in K}  # amax / 2688 to amax / 448


def test_a_modelopt_block_in_config_json_reads_like_hf_quant_config(base, tmp_path):
    tensors = {ATTN.format(i) + n: torch.tensor(s[i])
               for i in K for n, s in (("k_proj.k_scale", K), ("v_proj.v_scale", V))}
    qc = {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "NVFP4",
          "producer": {"name": "modelopt", "version": "0.41.0"}}
    readout = read_kv_scales(_with(base, tmp_path / "m", tensors, qc=qc))
    assert readout.nvfp4.conventions == ("modelopt-pre-0.42",)
    assert readout.nvfp4.why == "config.json producer ModelOpt 0.41.0"


def test_a_loader_that_reads_nvfp4_scales_only_beside_quantized_weights_runs_one_for_a_kv_only_folder(calibrated):
    """TensorRT-LLM at ed53795 with TRTLLM_LOAD_KV_SCALES=1 multiplies the scales by 6 in its FP8 and NVFP4 weight
    loaders; its unquantized one holds none, so a KV-only folder (fp8kv's) runs global scale 1.0 there."""
    out, stdout = calibrated
    (row,) = [loader for loader in NVFP4_LOADERS if not loader.loads_kv_only]
    assert (row.engine, row.release, row.setting, row.factor) == ("tensorrt-llm", "commit ed53795",
                                                                  "TRTLLM_LOAD_KV_SCALES=1", 6.0)
    kv_only = nvfp4_traits_of(out)
    assert kv_only.kv_only and not row.loads_for(kv_only) and row.loads_for(replace(kv_only, kv_only=False))
    (line,) = [line for line in nvfp4_lines(448.0, 1.25, "nvfp4", kv_only) if line.startswith(row.name)]
    assert line.startswith(f"{row.name}: does not load the scales of a KV-only folder (only beside quantized "
                           "weights): the global scale stays 1.0")
    assert f"  {line}\n" in stdout
    (quantized,) = [line for line in nvfp4_lines(448.0, 1.25, "nvfp4", replace(kv_only, kv_only=False))
                    if line.startswith(row.name)]
    assert quantized.startswith(f"{row.name}: x6 -> runs 6 x amax x 1.25 / 448 = amax x 1.25 / 74.67")
