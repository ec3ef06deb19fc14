"""Scale tensors read from safetensors bytes without torch agree with safetensors' own torch loading."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.source import read_float_values, read_safetensors_header
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Values that round differently in each dtype, a subnormal of float16, and the extremes a scale may hold.
VALUES = [0.0123456789, 3.1415926, 1e-6, 65504.0, float("inf"), float("-inf"), float("nan")]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("bytes") / "llama", num_kv_heads=2)


def _same(got: tuple[float, ...], expected: list[float]) -> bool:
    """Equal value for value, NaN included (struct and torch both keep it)."""
    return len(got) == len(expected) and all(a == b or (a != a and b != b) for a, b in zip(got, expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (len(VALUES),), (len(VALUES), 1, 1)], ids=str)
def test_values_match_safetensors_torch_loading(tmp_path, dtype, shape):
    values = torch.tensor(VALUES[:1] if len(shape) < 1 or shape == (1,) else VALUES, dtype=torch.float64)
    tensors = {"weight": torch.randn(64, 64), "scale": values.to(dtype).reshape(shape)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    header = read_safetensors_header(path)
    got = read_float_values(path, {"scale": header["scale"]})["scale"]
    with safe_open(str(path), framework="pt") as handle:
        expected = handle.get_tensor("scale").double().flatten().tolist()
    assert _same(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_scales_read_as_torch_reads_them(base, tmp_path, dtype):
    """[H, 1, 1] K and [H] V scales in any float dtype read as safetensors' tensors cast to float32."""
    folder = tmp_path / "m"
    shutil.copytree(base, folder)
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor([0.0123, 0.0456]).reshape(2, 1, 1),
              "model.layers.0.self_attn.v_scale": torch.tensor([0.0789, 0.0912]),
              "model.layers.1.self_attn.k_scale": torch.tensor([0.111, 0.222]).reshape(2, 1, 1),
              "model.layers.1.self_attn.v_scale": torch.tensor([0.333, 0.444]).reshape(2, 1, 1)}
    weights = load_file(folder / "model.safetensors")
    save_file({**weights, **{n: t.to(dtype) for n, t in scales.items()}}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["compression_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"strategy": "attn_head"}}
    (folder / "config.json").write_text(json.dumps(config))
    readout = read_kv_scales(folder)
    assert readout.scales is not None and readout.scales.strategy == "attn_head"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        for name in scales:
            layer, part = int(name.split(".")[2]), name.split(".")[-1][0]
            expected = handle.get_tensor(name).to(torch.float32).reshape(2, 1, 1)
            assert torch.equal(readout.scales.tensor(part, layer), expected)


def test_offsets_that_disagree_with_the_shape_name_file_and_tensor(tmp_path):
    body = struct.pack("<2f", 0.5, 0.25)
    header = json.dumps({"model.layers.0.self_attn.k_scale": {"dtype": "F32", "shape": [1],
                                                              "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)
    entries = read_safetensors_header(path)
    with pytest.raises(Fp8kvError, match=r"bad.safetensors: tensor 'model.layers.0.self_attn.k_scale' holds 8 bytes, "
                                         r"but 1 F32 values take 4; the file is corrupt"):
        read_float_values(path, entries)


def test_scales_hold_floats_and_give_float32_tensors():
    scales = KVScales.from_floats({0: [0.2, 0.3], 1: [0.2, 0.3]}, {0: [0.4, 0.5], 1: [0.6, 0.7]})
    assert scales.k[0] == (float(torch.tensor(0.2)), float(torch.tensor(0.3)))  # rounded to float32 once
    assert torch.equal(scales.tensor("v", 1), torch.tensor([0.6, 0.7]).reshape(2, 1, 1))
    with pytest.raises(Fp8kvError, match=r"K/V scales mix shapes \[\(1,\), \(2, 1, 1\)\]"):
        KVScales.from_floats({0: 0.1, 1: [0.2, 0.3]}, {0: 0.1, 1: [0.2, 0.3]})
    with pytest.raises(Fp8kvError, match=r"layer 0: K scale \[0.1\] is not float32 values"):
        KVScales({0: (0.1,)}, {0: (0.5,)})
