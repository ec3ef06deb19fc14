"""Fuzz the checkpoint readers: any input gives a result or an `Fp8kvError`, never another exception.

Targets: config.json (geometry), the safetensors index, the safetensors header, scale tensors
and the legacy vLLM JSON. The budget per test is FP8KV_FUZZ_EXAMPLES (default 50) so CI stays
fast; set it higher for a long session (see docs/development.md).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.source import SourceCheckpoint, read_safetensors_header
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.tools.factory import make_checkpoint

EXAMPLES = int(os.environ.get("FP8KV_FUZZ_EXAMPLES", "50"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="FP8KV_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
CONFIG_KEYS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
               "layer_types", "sliding_window", "use_sliding_window", "num_kv_shared_layers", "kv_lora_rank",
               "text_config", "model_type", "vocab_size", "quantization_config", "compression_config"]
small_ints = st.integers(-3, 70)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("fuzz") / "src")


def scratch(base: Path) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fp8kv-fuzz-"))
    shutil.copytree(base, folder / "m")
    return folder / "m"


def result_or_own_error(fn, *args) -> None:
    try:
        fn(*args)
    except Fp8kvError as exc:
        assert str(exc).strip(), "an Fp8kvError needs a message"


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), small_ints | json_values, max_size=10))
def test_config_fuzz(config):
    result_or_own_error(AttentionGeometry.from_config, config)


@FUZZ
@given(st.fixed_dictionaries({"num_hidden_layers": small_ints, "num_attention_heads": small_ints,
                              "hidden_size": small_ints}, optional={k: small_ints | json_values for k in CONFIG_KEYS[3:] if k != "hidden_size"}))
def test_config_fuzz_near_valid(config):
    result_or_own_error(AttentionGeometry.from_config, config)


@FUZZ
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_config_file_bytes_fuzz(base, raw):
    folder = scratch(base)
    (folder / "config.json").write_bytes(raw)
    try:
        result_or_own_error(SourceCheckpoint.open, folder)
    finally:
        shutil.rmtree(folder.parent)


def _header_bytes(draw_header: bytes, declared: int | None, tail: bytes) -> bytes:
    length = len(draw_header) if declared is None else declared
    return struct.pack("<Q", length % 2**64) + draw_header + tail


tensor_entry = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "BF16", "I32", "U8", "XX"]) | json_values,
                                      "shape": st.lists(st.integers(-2, 5), max_size=3) | json_values,
                                      "data_offsets": st.lists(st.integers(-8, 80), max_size=3) | json_values})


@FUZZ
@given(st.dictionaries(st.text(max_size=30), tensor_entry | json_values, max_size=4) | json_values,
       st.none() | st.integers(0, 2**64 - 1), st.binary(max_size=80))
def test_safetensors_header_fuzz(header, declared, tail):
    raw = json.dumps(header).encode()
    with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as handle:
        handle.write(_header_bytes(raw, declared, tail))
    try:
        result_or_own_error(read_safetensors_header, Path(handle.name))
    finally:
        os.unlink(handle.name)


@FUZZ
@given(st.binary(max_size=200))
def test_safetensors_raw_bytes_fuzz(raw):
    with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as handle:
        handle.write(raw)
    try:
        result_or_own_error(read_safetensors_header, Path(handle.name))
    finally:
        os.unlink(handle.name)


index_names = st.sampled_from(["model.safetensors", "../x.safetensors", "/abs.safetensors", "a\\b.safetensors",
                               "missing.safetensors", "config.json", "", "."]) | st.text(max_size=20)


@FUZZ
@given(st.dictionaries(st.text(max_size=40), index_names | json_values, max_size=4) | json_values,
       st.booleans())
def test_index_fuzz(base, weight_map, wrap):
    folder = scratch(base)
    index = {"metadata": {}, "weight_map": weight_map} if wrap else weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    try:
        result_or_own_error(SourceCheckpoint.open, folder)
    finally:
        shutil.rmtree(folder.parent)


SCALE_NAMES = ["model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale",
               "model.layers.{}.self_attn.k_proj.k_scale", "model.layers.{}.self_attn.v_proj.v_scale",
               "model.layers.{}.self_attn.k_proj.output_scale", "model.layers.{}.self_attn.kv_scale"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool]


@st.composite
def scale_tensors(draw):
    tensors = {}
    for _ in range(draw(st.integers(1, 5))):
        name = draw(st.sampled_from(SCALE_NAMES)).format(draw(st.integers(0, 3)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        value = draw(st.floats(allow_nan=True, allow_infinity=True, width=16))
        tensors[name] = torch.full(shape, value).to(dtype) if dtype != torch.bool else torch.zeros(shape, dtype=dtype)
    return tensors


@FUZZ
@given(scale_tensors())
def test_scale_tensor_fuzz(base, tensors):
    folder = scratch(base)
    save_file(tensors, str(folder / "kv_scales.safetensors"))
    try:
        result_or_own_error(read_kv_scales, folder)
    finally:
        shutil.rmtree(folder.parent)


@FUZZ
@given(json_values, st.dictionaries(st.sampled_from(["dtype", "scaling_factor"]), json_values, max_size=2),
       st.dictionaries(st.text(max_size=3), st.dictionaries(st.text(max_size=3), json_scalars, max_size=3), max_size=2),
       st.none() | json_values)
def test_legacy_vllm_json_fuzz(base, model_type, cache, scaling, exact):
    folder = scratch(base)
    data = {"model_type": model_type, "kv_cache": {"scaling_factor": scaling, **cache}}
    if exact is not None:
        data["fp8kv"] = exact
    (folder / "kv_cache_scales.json").write_text(json.dumps(data))
    try:
        result_or_own_error(read_kv_scales, folder)
    finally:
        shutil.rmtree(folder.parent)
