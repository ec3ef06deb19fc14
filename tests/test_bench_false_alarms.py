"""bench/verify_false_alarms.py's damaged NVFP4 folders: each stores the calibrated global scales times what its case
names, and reads as ModelOpt 0.42's export (amax / 448), the label another tool would give it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp8kv.checkpoint.conventions import SCALES_FILE
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.nvfp4 import MODELOPT
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.models import BUNDLED_MODEL_DIR

BENCH = Path(__file__).parents[1] / "bench"
ATTN = "model.layers.{}.self_attn."


def _bench() -> Any:
    sys.path.insert(0, str(BENCH))  # the script imports bench/common.py as `common`, as when run from bench/
    try:
        spec = importlib.util.spec_from_file_location("verify_false_alarms", BENCH / "verify_false_alarms.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


BENCH_SCRIPT = _bench()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    """The bundled model's NVFP4 folder as calibrate writes it (ModelOpt's files, fp8kv's producer naming amax / 448),
    at made-up scales: no model runs."""
    layers = range(4)
    scales = KVScales.from_floats({i: 0.0123456 * (i + 1) for i in layers}, {i: 0.0345678 / (i + 1) for i in layers},
                                  kv_dtype="nvfp4")
    return write_checkpoint(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("nvfp4") / "good", scales, convention="modelopt")


@pytest.mark.parametrize("case, factor", [("/6 (amax / 2688 labelled amax / 448)", 1 / 6), ("x6", 6.0),
                                          ("x0.25", 0.25)])
def test_each_rewrite_stores_its_multiple_and_reads_as_modelopt_042(calibrated, tmp_path, case, factor):
    folder = BENCH_SCRIPT.damaged_copy(calibrated, tmp_path / "damaged", BENCH_SCRIPT.DAMAGES["nvfp4"][case])
    good, damaged = load_file(calibrated / SCALES_FILE), load_file(folder / SCALES_FILE)
    assert sorted(damaged) == sorted(good) and len(good) == 8  # k_proj.k_scale and v_proj.v_scale of 4 layers
    for name, value in good.items():
        assert damaged[name].dtype == torch.float32 and damaged[name].shape == ()
        # the multiple, up to the one float32 rounding of the product (1/6 is no float32)
        assert abs(damaged[name].item() - value.item() * factor) <= 2 ** -23 * value.item() * factor
    meta = json.loads((folder / "hf_quant_config.json").read_text())
    assert meta["producer"] == {"name": "modelopt", "version": "0.42.0"}
    assert meta["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    reading = read_kv_scales(folder).nvfp4
    assert reading is not None and reading.known == MODELOPT, reading  # what the folder says: amax / 448
    assert reading.why == "hf_quant_config.json producer ModelOpt 0.42.0"  # told by ModelOpt's label, not fp8kv's


def test_the_swap_exchanges_one_layers_k_and_v_under_either_naming(calibrated, tmp_path):
    folder = BENCH_SCRIPT.damaged_copy(calibrated, tmp_path / "swapped", BENCH_SCRIPT.DAMAGES["nvfp4"]["K/V swapped"])
    good, damaged = load_file(calibrated / SCALES_FILE), load_file(folder / SCALES_FILE)
    k, v = ATTN.format(0) + "k_proj.k_scale", ATTN.format(0) + "v_proj.v_scale"
    assert good[k].item() != good[v].item()
    assert (damaged[k].item(), damaged[v].item()) == (good[v].item(), good[k].item())
    assert all(torch.equal(damaged[n], good[n]) for n in good if n not in (k, v))
    fp8 = {ATTN.format(i) + side: torch.tensor([float(i + j)]) for i in (0, 1) for j, side in
           enumerate(("k_scale", "v_scale"))}
    swapped = BENCH_SCRIPT.swap_first_layer(fp8)
    assert swapped[ATTN.format(0) + "k_scale"].item() == 1.0 and swapped[ATTN.format(0) + "v_scale"].item() == 0.0
    assert swapped[ATTN.format(1) + "k_scale"].item() == 1.0 and swapped[ATTN.format(1) + "v_scale"].item() == 2.0
