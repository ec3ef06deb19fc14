"""Multi-head latent attention (DeepSeek V2/V3 and descendants): the latent cache vLLM keeps, observed exactly.

vLLM's MLA cache stores one vector per token and layer, `concat(kv_c_normed, k_pe)`, quantized with the
layer's one k_scale. fp8kv must observe that vector (not the per-head K/V attention expands it into),
with the same scale formula as every other layer.
"""

from __future__ import annotations

import pytest
import torch

from fp8kv.geometry import AttentionGeometry, LatentCache
from fp8kv.tools.zoo import make_zoo_checkpoint
from fp8kv.tools.zoo_matrix import latent_cache_amax

SAMPLES = [list(range(5, 45)), list(range(60, 85)), list(range(100, 131))]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_zoo_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla") / "deepseek_v3")


def test_geometry_caches_one_latent_vector_per_layer(deepseek) -> None:
    geometry = AttentionGeometry.from_dir(deepseek)
    assert geometry.latent == LatentCache(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    assert geometry.latent.width == 24
    assert (geometry.kv_layers, geometry.num_kv_heads, geometry.head_dim) == ((0, 1), 1, 24)
    assert [geometry.layer_kv_heads(i) for i in (0, 1)] == [1, 1]


def test_an_mla_config_without_rope_width_is_refused(tmp_path) -> None:
    from fp8kv.errors import Fp8kvError
    from fp8kv.geometry import text_config

    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
              "kv_lora_rank": 16}
    with pytest.raises(Fp8kvError, match=r"^cfg: 'qk_rope_head_dim' is missing; a multi-head latent attention "
                                         r"\(MLA\) config with kv_lora_rank needs it$"):
        LatentCache.from_config(text_config(config), "cfg")


def test_layers_of_different_latent_layouts_are_refused(tmp_path) -> None:
    """dots3_note: its sliding and indexed layers cache latents of different widths (per-layer configs)."""
    from transformers import AutoConfig

    from fp8kv.errors import Fp8kvError

    AutoConfig.for_model("dots3_note").save_pretrained(tmp_path)
    with pytest.raises(Fp8kvError, match=r"config.json: its layers cache multi-head latent attention \(MLA\) "
                                         r"vectors of different layouts .*; fp8kv handles one latent layout per model$"):
        AttentionGeometry.from_dir(tmp_path)


def test_latent_amax_equals_the_models_own_latent_exactly(deepseek) -> None:
    """kv_a_layernorm's output and the rope key after RoPE, read with hooks, against fp8kv's statistics."""
    from fp8kv.checkpoint.load import load_language_model
    from fp8kv.data import make_batches
    from fp8kv.observe import K, V, observe

    geometry = AttentionGeometry.from_dir(deepseek)
    model = load_language_model(deepseek, torch.device("cpu"), "auto")
    statistics = observe(model, make_batches(SAMPLES, 1, 0), geometry)
    reference = latent_cache_amax(deepseek, SAMPLES)
    assert sorted(reference) == [0, 1]
    for layer in (0, 1):
        assert float(statistics.amax[layer, K, 0]) == float(reference[layer][0]) > 0
        assert float(statistics.amax[layer, V, 0]) == float(reference[layer][0])
        assert int(statistics.tokens[layer]) == sum(map(len, SAMPLES))
        # every cached value of the latent (width 24) was counted once per slot
        assert int(statistics.hist[layer, K, 0].sum()) == sum(map(len, SAMPLES)) * 24


def test_padding_is_not_observed_in_the_latent(deepseek) -> None:
    """A right-padded batch folds only real tokens: the amax equals the unpadded run's."""
    from fp8kv.checkpoint.load import load_language_model
    from fp8kv.data import make_batches
    from fp8kv.observe import observe

    geometry = AttentionGeometry.from_dir(deepseek)
    model = load_language_model(deepseek, torch.device("cpu"), "auto")
    padded = observe(model, make_batches(SAMPLES, 3, 0), geometry)
    assert padded.tokens.tolist() == [sum(map(len, SAMPLES))] * 2
    assert int(padded.hist[0, 0, 0].sum()) == sum(map(len, SAMPLES)) * 24


@pytest.fixture(scope="module")
def calibrated(deepseek, tmp_path_factory):
    """fp8kv calibrate on the tiny DeepSeek V3, through the CLI, with the default headroom."""
    from typer.testing import CliRunner

    from fp8kv.cli import app
    from fp8kv.tools.zoo_matrix import corpus

    root = tmp_path_factory.mktemp("mla-out")
    out = root / "out"
    result = CliRunner().invoke(app, ["calibrate", str(deepseek), "--dataset", corpus(root), "--num-samples", "3",
                                      "--seq-len", "48", "--batch-size", "1", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_checkpoint_holds_one_latent_scale_per_layer_as_k_scale(calibrated, deepseek) -> None:
    """k_scale = the scale formula over the latent's amax; v_scale repeats it; inspect reads it back as MLA."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from fp8kv.calibrate.scales import scale_from_amax
    from fp8kv.options import DEFAULT_HEADROOM
    from fp8kv.checkpoint.conventions import SCALES_FILE
    from fp8kv.cli import app
    from fp8kv.data import DataRequest, load_calibration_data
    from fp8kv.tools.zoo_matrix import NUM_SAMPLES, SEQ_LEN, corpus

    tensors = load_file(calibrated / SCALES_FILE)
    assert sorted(tensors) == [f"model.layers.{i}.self_attn.{k}_scale" for i in (0, 1) for k in "kv"]
    data = DataRequest(dataset=corpus(calibrated.parent), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN)
    samples = load_calibration_data(data, AutoTokenizer.from_pretrained(deepseek)).samples
    reference = latent_cache_amax(deepseek, samples)
    for layer in (0, 1):
        expected = scale_from_amax(reference[layer][:1], headroom=DEFAULT_HEADROOM)
        assert torch.equal(tensors[f"model.layers.{layer}.self_attn.k_scale"], expected)
        assert torch.equal(tensors[f"model.layers.{layer}.self_attn.v_scale"], expected)
    report = json.loads(CliRunner().invoke(app, ["inspect", str(calibrated), "--json"]).stdout)
    assert report["latent"] == {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    assert (report["num_kv_heads"], report["kv_layers"]) == (1, [0, 1])
    assert [w.split(":")[0] for w in report["warnings"]] == ["MLA"]  # only the vLLM loader note
    text = " ".join(CliRunner().invoke(app, ["inspect", str(calibrated)]).stdout.split())
    assert "MLA latent cache: kv_lora_rank 16 + rope key 8 values per token, one scale per layer" in text


@pytest.mark.parametrize("target", ["modelopt", "quark", "vllm-json"])
def test_other_conventions_refuse_a_latent_cache_in_one_line(calibrated, tmp_path, target) -> None:
    from typer.testing import CliRunner

    from fp8kv.cli import app

    result = CliRunner().invoke(app, ["convert", str(calibrated), "--to", target, "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and not (tmp_path / "o").exists()
    line = f"{calibrated / 'config.json'}: deepseek_v3 caches one multi-head latent attention (MLA) vector per " \
           f"token; only compressed-tensors names its scale (k_scale on the attention module), {target} has no " \
           "name for it; use --format compressed-tensors"
    assert line in " ".join(result.output.split())


@pytest.mark.parametrize(("option", "message"), [
    ("--per-head", "quantized with one scale per layer; per-head scales do not apply (drop --per-head)"),
    ("--attention=fp8", "--attention fp8: deepseek_v3's multi-head latent attention quantizes its query in the "
                        "latent space (after kv_b_proj is folded in), which fp8kv does not observe"),
])
def test_options_without_meaning_for_a_latent_cache_are_refused(deepseek, tmp_path, option, message) -> None:
    from typer.testing import CliRunner

    from fp8kv.cli import app

    result = CliRunner().invoke(app, ["calibrate", str(deepseek), "--dataset", str(tmp_path / "unread.jsonl"),
                                      option, "--device", "cpu", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and not (tmp_path / "o").exists()
    assert message in " ".join(result.output.split())


def test_layer_by_layer_observes_the_same_latent_as_the_whole_model(tmp_path) -> None:
    """MiniCPM3 (dense MLA): --layerwise scales are bit-identical to the whole-model path."""
    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    from fp8kv.data import DataRequest
    from fp8kv.tools.zoo_matrix import corpus

    src = make_zoo_checkpoint("minicpm3", tmp_path / "minicpm3")
    data = DataRequest(dataset=corpus(tmp_path), num_samples=3, seq_len=48)
    tables = [calibrate(CalibrationRequest(model=str(src), data=data, batch_size=1, device="cpu", layerwise=by_layer)).table
              for by_layer in (True, False)]
    assert tables[0].layers == tables[1].layers == (0, 1)
    assert torch.equal(tables[0].scales, tables[1].scales) and torch.equal(tables[0].amax, tables[1].amax)
    assert torch.equal(tables[0].scales[:, 0], tables[0].scales[:, 1])  # one latent scale, as K and as V


def test_verify_runs_the_latent_cache_and_passes(calibrated, tmp_path) -> None:
    """verify on the MLA checkpoint: its bf16 runtime is transformers, the scales read back, fp8 passes."""
    import json

    from typer.testing import CliRunner

    from fp8kv.cli import app

    result = CliRunner().invoke(app, ["verify", str(calibrated), "--dataset", "bundled", "--num-samples", "3", "--seq-len", "64",
                                      "--num-prompts", "2", "--new-tokens", "4", "--device", "cpu",
                                      "--report", str(tmp_path / "report")])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert result.exit_code == 0 and report["verdict"] == "PASS", result.output
    assert report["fidelity"]["kl_mean"] <= 1e-6 and report["readback"] == {"equal": True, "layers": 2, "mismatches": []}
    assert 0.0 < report["accuracy"]["kl_mean"] < 1e-4


def test_the_vllm_loader_gap_is_named_and_grows_to_a_warning_past_max(calibrated) -> None:
    """vLLM runs an MLA latent cache at scale 1.0: a note while the latent fits fp8 at 1.0, a WARN past MAX."""
    from dataclasses import replace

    from fp8kv.checks import INFO, WARN, check_readout, tpu_layout_findings
    from fp8kv.checkpoint.provenance import read_provenance
    from fp8kv.checkpoint.reader import read_kv_scales

    readout, provenance = read_kv_scales(calibrated), read_provenance(calibrated)
    assert tpu_layout_findings(readout) == []  # the K/V head_dim padding note is about another cache layout
    notes = [f for f in check_readout(readout, provenance) if f.message.startswith("MLA: vLLM")]
    assert [f.level for f in notes] == [INFO] and "fits at 1.0" in notes[0].message
    big = replace(provenance, layers=(replace(provenance.layers[0], k=replace(provenance.layers[0].k, amax=600.0)),))
    warned = [f for f in check_readout(readout, big) if f.message.startswith("MLA: vLLM")]
    assert [f.level for f in warned] == [WARN] and "amax 600 exceeds 448" in warned[0].message
