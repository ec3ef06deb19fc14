"""Each engine release row (configs/engines.toml) against what the release's own code did, as its probe recorded it
under tests/golden/ (`probes/probe_engines.sh` writes them again for a new release); no engine is installed here."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8kv import engine_models
from fp8kv.engine_models import (
    FP8_K_NVFP4_V_RELEASES, NVFP4_LOADERS, RELEASE_MODELS, activation_divide, engine_model,
)
from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import to_fp8

GOLDEN = Path(__file__).parent / "golden"
E4M3 = torch.float8_e4m3fn


def golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text(encoding="utf-8"))


def test_every_golden_file_named_by_a_row_exists_and_every_record_has_a_row():
    named = {name for m in RELEASE_MODELS if m.release for name in (m.release.golden, m.release.loaders) if name}
    named |= {loader.golden for loader in NVFP4_LOADERS if loader.golden}
    records = {path.name for path in GOLDEN.glob("*.json")}
    assert named <= records
    # each record backs a row (a probe's extra files, like the tpu-inference bytes, sit beside its JSON), or rows of
    # many releases read from their wheels, or vLLM's CUDA wheel's Python against the CPU wheel's, or the sm100 page
    # layout of FlashInfer, the library vLLM's NVFP4 attention runs (test_nvfp4_cache.py checks the cache against it),
    # or what of SGLang's NVFP4 write and read runs on a CPU (test_nvfp4_sglang.py)
    assert records - named <= {"sglang-releases.json", "vllm-cuda-python-0.32.0.json",
                               "nvfp4-flashinfer-0.7.0.post1.json", "nvfp4-sglang-write-0.5.23.json"}


def _all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern, in order: the tpu-inference probe's input set."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


TPU = golden("tpu-inference-0.32.0.json")
TPU_BYTES = load_file(GOLDEN / "tpu-inference-0.32.0.safetensors")


@pytest.mark.parametrize("scale", sorted(TPU["scales"]))
def test_tpu_inference_stores_the_bytes_its_compiled_tpu_program_stores(scale):
    x = _all_bf16()
    finite = torch.isfinite(x)
    s = torch.tensor(float(scale))
    for name in ("tpu-inference", "tpu-inference-vllm"):
        stored = engine_model(name).write(x, s, E4M3).view(torch.uint8)[finite]
        assert hashlib.sha256(stored.numpy().tobytes()).hexdigest() == TPU["scales"][scale]["sha256_finite"][
            "tpu-compiled"], (name, scale)
        if f"tpu-compiled/scale={scale}" in TPU_BYTES:
            assert torch.equal(stored, TPU_BYTES[f"tpu-compiled/scale={scale}"][finite]), (name, scale)
    # on JAX's CPU backend the same write divides in bf16 (rounding twice), as SGLang's torch division does
    on_cpu = to_fp8(activation_divide(x, s), E4M3, saturate=True).view(torch.uint8)[finite]
    assert hashlib.sha256(on_cpu.numpy().tobytes()).hexdigest() == TPU["scales"][scale]["sha256_finite"]["cpu"]


def test_tpu_inference_rows_name_the_model_paths_its_source_has():
    paths = TPU["model_paths"]
    assert paths["model_impl_type"]["default"] == "auto"
    jax_models = set(paths["jax_registry"]["architectures"]) - set(paths["vllm_preferred"]["architectures"])
    default = engine_model("tpu-inference").release
    assert default is not None and set(default.unread_architectures) == jax_models
    # every scale its JAX models hold is a constant, 1.0
    assert paths["jax_scale_attributes"]["only_constants"] and paths["jax_scale_attributes"]["constants"] == [1.0]
    configs = paths["quantization_configs"]["configs"]
    loads = {name for name, row in configs.items()
             if any("KVCacheMethod" in returned for returned in row.get("attention", {}).get("returns", []))}
    for name in ("tpu-inference", "tpu-inference-vllm"):
        release = engine_model(name).release
        assert release is not None and set(release.conventions) == loads == {"compressed-tensors"}
        assert engine_model(name).release.versions == (TPU["provenance"]["tpu_inference"],) * 2


VLLM = golden("vllm-releases.json")


def test_vllm_tpu_covers_the_one_wheel_whose_tpu_platform_is_vllms_own_fp8_write():
    own = [version for version, row in VLLM["vllm-tpu"].items()
           if row["default_backend"] == "vllm torch_xla" and any("/ k_scale" in line for line in row["write_lines"])]
    release = engine_model("vllm-tpu").release
    assert release is not None and release.superseded_by == "tpu-inference"
    assert [release.versions[0]] == own == [release.versions[1]]
    later = [v for v, row in VLLM["vllm-tpu"].items() if row["requires_tpu_inference"]]
    assert all(row["default_backend"] == "tpu-inference" for v, row in VLLM["vllm-tpu"].items() if v in later)


@pytest.mark.parametrize("engine", ["vllm-cuda", "vllm-triton"])
def test_vllm_cuda_rows_cover_releases_whose_packages_show_the_write(engine):
    release = engine_model(engine).release
    assert release is not None and release.versions is not None
    checked = [v for v in VLLM["vllm"] if release.covers(v)]
    assert set(release.versions) <= set(checked)
    for version in checked:
        row = VLLM["vllm"][version]
        assert row["triton_write_lines"], version  # key / tl.load(k_scale): one float32 scalar
        assert row["per_tensor_only_lines"], version  # the generic KV-cache method takes a scalar per layer
    assert not engine_model("vllm-triton").release.per_head


SGLANG = golden("sglang-0.5.23.json")
SGLANG_RELEASES = golden("sglang-releases.json")


def test_sglang_rows_agree_with_every_release_read_from_its_wheel():
    for checked in SGLANG_RELEASES["releases"]:
        model = engine_model(f"sglang@{checked['version']}")
        assert model.saturate is checked["pinned_torch_saturates"], checked["version"]
        assert ("compressed-tensors" in model.release.conventions) is checked["loads_compressed_tensors_kv_scales"]
    newest = max(SGLANG_RELEASES["releases"], key=lambda r: tuple(int(p) for p in r["version"].split(".")))
    assert engine_model("sglang").release.versions[1] == newest["version"] == SGLANG["version"]


def test_sglang_holds_what_its_own_loader_held_for_each_fp8kv_output():
    release = engine_model("sglang").release
    loaded = {name for name, row in SGLANG["summary"].items() if row["loaded"] == "exactly"}
    # on Llama; Quark (and which classes hold what) comes from the loader matrix (tests/test_loader_matrix.py)
    assert loaded == {"compressed-tensors", "modelopt"} <= set(release.conventions)
    # without scale tensors its layers hold 1.0: the negative control tells loaded from defaulted
    assert SGLANG["summary"]["stripped"]["loaded"] == "1.0"
    for case in SGLANG["cases"]:
        if case["loaded"] == "exactly":
            assert all(row["held_k"] == row["file_k"] and row["held_v"] == row["file_v"] for row in case["layers"])
    assert SGLANG["cast"]["e4m3_saturates"] is engine_model("sglang").saturate is True


SGLANG_NVFP4 = golden("nvfp4-sglang-0.5.23.json")
SGLANG_NVFP4_ROWS = {gpu: loader for loader in NVFP4_LOADERS for gpu in loader.gpus
                     if (loader.engine, loader.release) == ("sglang", SGLANG_NVFP4["meta"]["sglang"])}


def test_sglangs_nvfp4_rows_are_the_gpu_generations_its_method_ran_for():
    assert SGLANG_NVFP4["how"] == "run" and SGLANG_NVFP4["meta"]["sglang"] == SGLANG["version"]
    assert set(SGLANG_NVFP4_ROWS) == {gpu for run in SGLANG_NVFP4["checkpoints"].values() for gpu in run["held"]}
    assert {(loader.evidence, loader.golden) for loader in SGLANG_NVFP4_ROWS.values()} == {
        ("run", "nvfp4-sglang-0.5.23.json")}
    # a stored 1.0 among the scales, so the keep-unit rule is checked, not vacuous
    assert any(1.0 in run["file"][side] for run in SGLANG_NVFP4["checkpoints"].values() for side in ("k", "v"))


@pytest.mark.parametrize("gpu", sorted(SGLANG_NVFP4_ROWS))
def test_sglangs_nvfp4_method_holds_the_stored_scale_times_its_rows_factor(gpu):
    """load_scales_from_model takes each stored float32 scale as a Python float, multiplies it by the factor (a
    stored 1.0 is kept where the row keeps it), and holds the product as it is and rounded into a float32 tensor."""
    loader = SGLANG_NVFP4_ROWS[gpu]
    assert loader.loads
    for name, run in SGLANG_NVFP4["checkpoints"].items():
        assert run["loaded"] == run["file"], name  # its loader put the file's values into each RadixAttention
        for side in ("k", "v"):
            expected = [s if loader.keeps_unit and s == 1.0 else s * loader.factor for s in run["file"][side]]
            assert run["held"][gpu][f"{side}_float"] == expected, (name, side)
            assert run["held"][gpu][side] == torch.tensor(expected, dtype=torch.float32).tolist(), (name, side)


def test_sglangs_nvfp4_rows_serve_with_the_kv_cache_dtype_whose_method_ran():
    assert SGLANG_NVFP4["kv_cache_dtype"] in SGLANG_NVFP4["kv_cache_dtype_choices"]
    for loader in SGLANG_NVFP4_ROWS.values():
        words = shlex.split(loader.serve)
        assert words[words.index("--kv-cache-dtype") + 1] == SGLANG_NVFP4["kv_cache_dtype"], loader.name


@pytest.mark.parametrize(("field", "value", "message"), [
    ("gpus", ["sm90", "sm89"], r"names GPU generations \['sm90', 'sm89'\]; each must be one of sm80, sm90, "
                               r"sm100, sm120$"),
    ("gpus", [], r"names GPU generations \[\]; each must be one of sm80"),
    ("write", "nvfp4_8over6", r"names write 'nvfp4_8over6'; each must be one of nvfp4, nvfp4_4over6"),
    ("refuses_head_dims", [64], r"gives refuses_head_dims or refusal without the other; a refusal needs both"),
])
def test_an_nvfp4_row_naming_an_unknown_gpu_generation_or_write_is_refused(monkeypatch, field, value, message):
    """The GPU generations and writes a row may name live in engine_models.NVFP4_GPUS and options.Nvfp4Write alone."""
    rows = [dict(row) for row in engine_models._rows("nvfp4")]
    rows[0][field] = value
    monkeypatch.setattr(engine_models, "_rows", lambda section: rows)
    with pytest.raises(Fp8kvError, match=r"engines.toml: the \[\[nvfp4\]\] row of vllm-cuda 0.32.0 " + message):
        engine_models._read_nvfp4_loaders()


def test_sglangs_fp8_k_nvfp4_v_row_matches_the_kv_cache_dtypes_its_command_line_took():
    """Its row says SGLang has no fp8 K / nvfp4 V cache: none of the choices its probe recorded is one."""
    (row,) = [r for r in FP8_K_NVFP4_V_RELEASES if (r.engine, r.release) == ("sglang", SGLANG_NVFP4["meta"]["sglang"])]
    assert "tests/golden/nvfp4-sglang-0.5.23.json" in row.source
    assert not [c for c in SGLANG_NVFP4["kv_cache_dtype_choices"] if "fp8" in c and "fp4" in c]
