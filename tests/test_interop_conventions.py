"""Golden checkpoints written the way each tool writes them, read back, converted and round-tripped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kv import __version__
from fp8kv.checkpoint.conventions import CONVENTIONS, QUARK_KV_ONLY_EXCLUDE, weight_method
from fp8kv.checkpoint.convert import convert_checkpoint
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.checks import check_readout
from fp8kv.errors import Fp8kvError
from fp8kv.inspection import scale_rows
from fp8kv.tools.factory import make_checkpoint

# Powers of two: exact in bfloat16, so a bf16 golden reads back bit-exactly.
K = {0: 0.015625, 1: 0.03125}
V = {0: 0.0625, 1: 0.125}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("base") / "llama")


def _with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qc: dict | None = None) -> Path:
    """Copy `src` and add `tensors` into its model.safetensors, as the tools save them (one file)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file({**weights, **tensors}, dst / "model.safetensors", metadata={"format": "pt"})
    if qc is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = qc
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def golden(base: Path, dst: Path, convention: str) -> Path:
    """A checkpoint holding K/V above in `convention`, with that tool's names, shapes, dtypes and configs."""
    attn = "model.layers.{}.self_attn."
    if convention == "compressed-tensors":  # llm-compressor: [1] in the model dtype, kv_cache_scheme
        tensors = {attn.format(i) + n: torch.tensor([s[i]], dtype=torch.bfloat16)
                   for i in K for n, s in (("k_scale", K), ("v_scale", V))}
        qc = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
              "config_groups": {}, "ignore": [], "kv_cache_scheme": {"num_bits": 8, "type": "float",
              "strategy": "tensor", "dynamic": False, "symmetric": True}}
        return _with_tensors(base, dst, tensors, qc)
    if convention == "modelopt":  # 0-dim float32 on k_proj/v_proj, plus hf_quant_config.json
        tensors = {attn.format(i) + n: torch.tensor(s[i], dtype=torch.float32)
                   for i in K for n, s in (("k_proj.k_scale", K), ("v_proj.v_scale", V))}
        out = _with_tensors(base, dst, tensors)
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.19.0"},
             "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}))
        return out
    if convention == "quark":  # Quark: 0-dim float32 output_scale, kv_cache_group in export
        tensors = {attn.format(i) + n: torch.tensor(s[i], dtype=torch.float32)
                   for i in K for n, s in (("k_proj.output_scale", K), ("v_proj.output_scale", V))}
        spec = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
        qc = {"quant_method": "quark", "global_quant_config": {"weight": None, "output_tensors": None},
              "layer_quant_config": {"*k_proj": {"output_tensors": spec}, "*v_proj": {"output_tensors": spec}},
              "export": {"kv_cache_group": ["*k_proj", "*v_proj"]}}
        return _with_tensors(base, dst, tensors, qc)
    if convention == "vllm-json":  # the old --quantization-param-path file: one value per layer
        out = shutil.copytree(base, dst)
        (out / "kv_cache_scales.json").write_text(json.dumps({"model_type": "llama", "kv_cache": {
            "dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(i): max(K[i], V[i]) for i in K}}}}))
        return out
    raise AssertionError(convention)


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt", "quark"])
def test_golden_reads_back_exact_k_and_v(base, tmp_path, convention):
    readout = read_kv_scales(golden(base, tmp_path / "g", convention))
    assert readout.conventions == (convention,)
    assert readout.scales.strategy == "tensor"
    assert {i: readout.scales.values(i) for i in K} == {i: ([K[i]], [V[i]]) for i in K}
    assert readout.declared[convention] is True
    assert readout.missing_layers == ()


def test_legacy_vllm_json_gives_one_value_per_layer(base, tmp_path):
    readout = read_kv_scales(golden(base, tmp_path / "g", "vllm-json"))
    assert readout.conventions == ("vllm-json",)
    assert {i: readout.scales.values(i) for i in K} == {i: ([V[i]], [V[i]]) for i in K}


def test_legacy_kv_scale_sets_k_and_v(base, tmp_path):
    tensors = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(K[i]) for i in K}
    readout = read_kv_scales(_with_tensors(base, tmp_path / "g", tensors))
    assert readout.conventions == ("kv_scale",)
    assert readout.scales.values(1) == ([K[1]], [K[1]])


def test_round_trip_through_every_convention_is_lossless(base, tmp_path):
    scales = KVScales.from_floats({0: 0.0123456, 1: 0.0234567}, {0: 0.0345678, 1: 0.0456789})
    current = write_checkpoint(base, tmp_path / "start", scales)
    for step, convention in enumerate([*CONVENTIONS, *CONVENTIONS[::-1]]):
        current = convert_checkpoint(current, tmp_path / f"{step}-{convention}", convention)
        readout = read_kv_scales(current)
        assert readout.conventions == (convention,)
        for layer in (0, 1):
            assert readout.scales.k[layer] == scales.k[layer] and readout.scales.v[layer] == scales.v[layer]


def test_per_head_scales_round_trip_and_refuse_single_value_formats(base, tmp_path):
    scales = KVScales.from_floats({0: [0.01, 0.02], 1: [0.03, 0.04]}, {0: [0.05, 0.06], 1: [0.07, 0.08]})
    out = write_checkpoint(base, tmp_path / "ct", scales)
    config = json.loads((out / "config.json").read_text())
    assert config["compression_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    readout = read_kv_scales(out)
    assert readout.scales.shape == (2, 1, 1) and readout.scales.v[1] == scales.v[1]
    with pytest.raises(Fp8kvError, match="per-head .* only be written as compressed-tensors, not modelopt"):
        convert_checkpoint(out, tmp_path / "mo", "modelopt")


def test_conventions_that_disagree_name_the_layer_and_both_values(base, tmp_path):
    ct = golden(base, tmp_path / "ct", "compressed-tensors")
    save_file({"model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.5)}, ct / "extra.safetensors")
    shutil.move(ct / "model.safetensors", ct / "model-1.safetensors")
    (ct / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model-1.safetensors" for n in load_file(ct / "model-1.safetensors")},
        "model.layers.1.self_attn.k_proj.k_scale": "extra.safetensors"}}))
    with pytest.raises(Fp8kvError) as err:
        read_kv_scales(ct)
    assert str(err.value).startswith("layer 1: compressed-tensors k_scale 0.03125 disagrees with modelopt k_scale 0.5")


def test_vllm_json_that_disagrees_with_tensors_is_an_error(base, tmp_path):
    ct = golden(base, tmp_path / "ct", "compressed-tensors")
    (ct / "scales.json").write_text(json.dumps(
        {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.0625, "1": 0.25}}}}))
    with pytest.raises(Fp8kvError, match=r"^layer 1: compressed-tensors max\(k,v\) kv_scale 0.125 disagrees"):
        read_kv_scales(ct)


def test_wrong_shape_or_dtype_scale_is_named(base, tmp_path):
    bad = _with_tensors(base, tmp_path / "shape", {"model.layers.0.self_attn.k_scale": torch.ones(2, 3)})
    with pytest.raises(Fp8kvError, match=r"model.safetensors: scale tensor model.layers.0.self_attn.k_scale has shape \[2, 3\]"):
        read_kv_scales(bad)
    bad = _with_tensors(base, tmp_path / "dtype", {"model.layers.0.self_attn.v_scale": torch.ones(1, dtype=torch.int32)})
    with pytest.raises(Fp8kvError, match="has dtype torch.int32; a KV scale must be a float"):
        read_kv_scales(bad)


def test_language_model_prefix_maps_to_layers():
    from fp8kv.checkpoint.conventions import layer_prefix, parse_scale_name

    assert parse_scale_name("model.language_model.layers.7.self_attn.k_proj.output_scale") == (7, "k", "quark")
    assert parse_scale_name("model.layers.3.self_attn.v_scale") == (3, "v", "compressed-tensors")
    assert parse_scale_name("model.layers.3.self_attn.k_proj.weight_scale") is None
    assert layer_prefix(["lm_head.weight", "model.language_model.layers.0.self_attn.q_proj.weight"]) == \
        "model.language_model."


def test_scale_names_follow_each_architectures_attention_module():
    from fp8kv.checkpoint.conventions import attention_modules, parse_scale_name, scale_names

    names = {
        "gpt2": "transformer.h.1.attn.c_attn.weight",
        "gpt_neox": "gpt_neox.layers.1.attention.query_key_value.weight",
        "dbrx": "transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight",
        "falcon": "transformer.h.1.self_attention.query_key_value.weight",
        "llava": "model.language_model.layers.1.self_attn.k_proj.weight",
    }
    expected = {
        "gpt2": "transformer.h.1.attn", "gpt_neox": "gpt_neox.layers.1.attention",
        "dbrx": "transformer.blocks.1.norm_attn_norm.attn", "falcon": "transformer.h.1.self_attention",
        "llava": "model.language_model.layers.1.self_attn",
    }
    for arch, weight in names.items():
        vision = "model.vision_tower.vision_model.encoder.layers.1.self_attn.k_proj.weight"
        modules = attention_modules([vision, weight], (1,))
        assert modules == {1: expected[arch]}, arch
        k_name, v_name = scale_names("compressed-tensors", modules[1], arch)
        assert (parse_scale_name(k_name), parse_scale_name(v_name)) == ((1, "k", "compressed-tensors"),
                                                                        (1, "v", "compressed-tensors"))
    assert attention_modules(["model.embed_tokens.weight"], (0,)) == {0: "model.layers.0.self_attn"}
    assert parse_scale_name("transformer.h.0.attn.k_proj.k_scale") == (0, "k", "modelopt")


# --- checkpoints whose weights are already quantized --------------------------------------------------

FP8_GROUP = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_compressed_tensors_fp8_config_gets_kv_cache_scheme_merged(base, tmp_path):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": FP8_GROUP, "ignore": ["lm_head"]}
    src = _with_tensors(base, tmp_path / "w8", {}, qc)
    out = write_checkpoint(src, tmp_path / "out", KVScales.from_floats(K, V))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {**qc, "kv_cache_scheme": KV_SCHEME}
    assert "compression_config" not in config  # transformers users of this source already run compressed-tensors
    with pytest.raises(Fp8kvError, match="quantized with 'compressed-tensors'.* only as compressed-tensors or vllm-json"):
        write_checkpoint(src, tmp_path / "q", KVScales.from_floats(K, V), convention="quark")


def test_fp8_weights_described_under_compression_config_keep_that_key(base, tmp_path):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": FP8_GROUP}
    src = _under_compression_config(_with_tensors(base, tmp_path / "w8", {}, qc))
    out = write_checkpoint(src, tmp_path / "out", KVScales.from_floats(K, V))
    config = json.loads((out / "config.json").read_text())
    assert config["compression_config"] == {**qc, "kv_cache_scheme": KV_SCHEME}
    assert "quantization_config" not in config
    with pytest.raises(Fp8kvError, match="quantized with 'compressed-tensors'.* only as compressed-tensors or vllm-json"):
        write_checkpoint(src, tmp_path / "q", KVScales.from_floats(K, V), convention="quark")


def test_autofp8_checkpoint_gets_output_scales_and_static_kv_scheme(base, tmp_path):
    qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    src = _with_tensors(base, tmp_path / "fp8", {}, qc)
    out = write_checkpoint(src, tmp_path / "out", KVScales.from_floats(K, V), convention="quark")
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {**qc, "kv_cache_scheme": "static"}
    readout = read_kv_scales(out)
    assert readout.conventions == ("quark",) and readout.declared["fp8"]
    with pytest.raises(Fp8kvError, match="quantized with 'fp8'.* only as quark or vllm-json"):
        write_checkpoint(src, tmp_path / "ct", KVScales.from_floats(K, V))


def test_modelopt_fp8_checkpoint_keeps_its_algo_and_gains_kv(base, tmp_path):
    src = shutil.copytree(base, tmp_path / "mo")
    hf = {"producer": {"name": "modelopt", "version": "0.19.0"},
          "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    (src / "hf_quant_config.json").write_text(json.dumps(hf))
    out = write_checkpoint(src, tmp_path / "out", KVScales.from_floats(K, V), convention="modelopt")
    written = json.loads((out / "hf_quant_config.json").read_text())
    assert written["quantization"] == {**hf["quantization"], "kv_cache_quant_algo": "FP8"}
    assert "model.layers.0.self_attn.k_proj.k_scale" in load_file(out / "kv_scales.safetensors")


def test_other_weight_quantization_is_refused_by_name(base, tmp_path):
    src = _with_tensors(base, tmp_path / "gptq", {}, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(Fp8kvError, match="quantized with quant_method 'gptq', which fp8kv cannot add"):
        write_checkpoint(src, tmp_path / "out", KVScales.from_floats(K, V))
    assert not (tmp_path / "out").exists()


def test_converting_replaces_old_scales_instead_of_keeping_both(base, tmp_path):
    src = golden(base, tmp_path / "mo", "modelopt")
    out = convert_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    assert not (out / "hf_quant_config.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("k_proj.k_scale" in name for name in index)
    weights = load_file(out / index["model.embed_tokens.weight"])
    assert not any("scale" in name for name in weights)
    assert read_kv_scales(out).conventions == ("compressed-tensors",)


# --- which config key holds the compressed-tensors block ----------------------------------------------

def _under_compression_config(folder: Path) -> Path:
    """`folder` with its quantization_config moved to compression_config (older llm-compressor, fp8kv)."""
    config = json.loads((folder / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _blocks(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return {key: config[key] for key in ("quantization_config", "compression_config") if key in config}


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
def test_inspect_and_verify_read_a_kv_cache_scheme_under_either_key(base, tmp_path, key):
    from fp8kv.inspection import inspect_checkpoint
    from fp8kv.verify.static import static_checks

    src = golden(base, tmp_path / "g", "compressed-tensors")
    if key == "compression_config":
        _under_compression_config(src)
    assert list(_blocks(src)) == [key]
    readout = read_kv_scales(src)
    assert readout.declared["compressed-tensors"] and readout.has_kv_cache_scheme
    assert not [f for f in check_readout(readout) if "kv_cache_scheme" in f.message]
    assert inspect_checkpoint(src).declared["compressed-tensors"] is True
    assert static_checks(src).summary().has_kv_cache_scheme is True


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
def test_convert_round_trip_through_modelopt_ends_with_one_compression_config(base, tmp_path, key):
    src = golden(base, tmp_path / "g", "compressed-tensors")
    if key == "compression_config":
        _under_compression_config(src)
    modelopt = convert_checkpoint(src, tmp_path / "mo", "modelopt")
    assert _blocks(modelopt) == {}  # the KV cache is declared in hf_quant_config.json alone
    back = convert_checkpoint(modelopt, tmp_path / "ct", "compressed-tensors")
    assert list(_blocks(back)) == ["compression_config"]
    assert _blocks(back)["compression_config"]["kv_cache_scheme"] == KV_SCHEME
    readout = read_kv_scales(back)
    assert {i: readout.scales.values(i) for i in K} == {i: ([K[i]], [V[i]]) for i in K}


def test_a_stale_kv_only_block_never_survives_a_rewrite(base, tmp_path):
    first = write_checkpoint(base, tmp_path / "first", KVScales.from_floats(K, V))
    config = json.loads((first / "config.json").read_text())
    stale = {**config["compression_config"], "kv_cache_scheme": {**KV_SCHEME, "strategy": "attn_head"}}
    config["quantization_config"] = stale  # as an older fp8kv or llm-compressor wrote it
    (first / "config.json").write_text(json.dumps(config))
    expected = {"compression_config": {**stale, "kv_cache_scheme": KV_SCHEME}}
    assert _blocks(write_checkpoint(first, tmp_path / "again", KVScales.from_floats(V, K))) == expected
    assert _blocks(convert_checkpoint(first, tmp_path / "ct", "compressed-tensors")) == expected
    assert _blocks(convert_checkpoint(first, tmp_path / "json", "vllm-json")) == {}


def test_kv_only_modelopt_names_a_weight_algo_that_excludes_every_module(base, tmp_path):
    # vLLM 0.32 refuses a null quant_algo; FP8 with every module excluded is the form it loads
    out = write_checkpoint(base, tmp_path / "mo", KVScales.from_floats(K, V), convention="modelopt")
    assert json.loads((out / "hf_quant_config.json").read_text()) == {
        "producer": {"name": "fp8kv", "version": __version__}, "quant_method": "modelopt",
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["*"]}}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "compression_config" not in config
    # read back as unquantized weights: every format can be written from it again
    assert weight_method(config, json.loads((out / "hf_quant_config.json").read_text())) is None
    again = convert_checkpoint(out, tmp_path / "ct", "compressed-tensors")
    assert scale_rows(read_kv_scales(again).scales) == scale_rows(read_kv_scales(out).scales)


def test_kv_only_quark_excludes_every_module_but_vllms_attention_layers(base, tmp_path):
    out = write_checkpoint(base, tmp_path / "quark", KVScales.from_floats(K, V), convention="quark")
    block = json.loads((out / "config.json").read_text())["compression_config"]
    assert block["exclude"] == [QUARK_KV_ONLY_EXCLUDE] == ["re:.*(?<!\\.attn)$"]
    assert block["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    pattern = QUARK_KV_ONLY_EXCLUDE.removeprefix("re:")  # vLLM applies re.match to its module names
    for linear in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.experts",
                   "lm_head", "transformer.h.0.attn.c_attn", "gpt_neox.layers.0.attention.query_key_value"):
        assert re.match(pattern, linear), linear
    for attention in ("model.layers.0.self_attn.attn", "transformer.h.0.attn.attn", "gpt_neox.layers.1.attention.attn"):
        assert not re.match(pattern, attention), attention
    assert weight_method(json.loads((out / "config.json").read_text()), None) is None


@pytest.mark.parametrize("convention, said", [
    ("modelopt", "hf_quant_config.json names no quant_algo: vLLM (0.32) loads ModelOpt KV scales only beside one "
                 "(\"'QKVParallelLinear' object has no attribute 'data'\"); fp8kv convert --to modelopt writes the "
                 "form vLLM loads"),
    ("quark", "the Quark config quantizes no weights and excludes no module: vLLM (0.32) then finds no scheme for the "
              "linear layers (\"No quark compatible scheme was found\"); fp8kv convert --to quark writes the form "
              "vLLM loads"),
])
def test_the_tools_own_kv_only_folders_are_flagged_and_fp8kvs_are_not(base, tmp_path, convention, said):
    tools = golden(base, tmp_path / "tool", convention)  # as ModelOpt / Quark write a KV-only export
    assert [f.message for f in check_readout(read_kv_scales(tools)) if "vLLM (0.32)" in f.message] == [said]
    ours = convert_checkpoint(tools, tmp_path / "ours", convention)
    assert not [f for f in check_readout(read_kv_scales(ours)) if "vLLM (0.32)" in f.message]


def test_every_row_of_the_convention_table_names_its_tensors():
    from fp8kv.checkpoint.conventions import SCALE_CONVENTIONS, parse_scale_name

    for row in SCALE_CONVENTIONS:
        for suffix, kind in row.tensors:
            assert parse_scale_name(f"model.layers.3.self_attn.{suffix}") == (3, kind, row.name)
    assert [row.name for row in SCALE_CONVENTIONS if not row.tensors] == ["vllm-json"]


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt", "quark"])
def test_each_golden_is_declared_by_its_own_row_alone(base, tmp_path, convention):
    readout = read_kv_scales(golden(base, tmp_path / "g", convention))
    assert readout.declared == {key: key == convention for key in ("compressed-tensors", "modelopt", "quark", "fp8")}


def test_a_declaration_of_the_wrong_shape_declares_nothing(base, tmp_path):
    out = golden(base, tmp_path / "g", "modelopt")
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": ["kv_cache_quant_algo"]}))
    readout = read_kv_scales(out)
    assert readout.conventions == ("modelopt",) and readout.declared["modelopt"] is False
    assert any("without kv_cache_quant_algo" in f.message for f in check_readout(readout))
