"""vLLM 0.32.0's CUDA wheel against the CPU wheel the loader matrix ran, as probes/vllm_cuda_python.py recorded them:
the Python a scale's load runs through is the same file for file, and branches on the platform only where the
golden file says."""

from __future__ import annotations

import json
from pathlib import Path

GOLDEN = json.loads((Path(__file__).parent / "golden" / "vllm-cuda-python-0.32.0.json").read_text(encoding="utf-8"))


def test_every_python_file_of_the_cpu_wheel_is_the_cuda_wheels_but_three_outside_the_loader():
    assert GOLDEN["python_files"]["shared"] == GOLDEN["python_files"]["cpu"] and not GOLDEN["only_cpu"]
    # the version string, the name the package reads its version from, the CPU's own slot-mapping kernel wrapper
    assert GOLDEN["differ"] == ["vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"]
    # the CUDA wheel adds kernels only
    assert all(folder.startswith(("vllm/third_party/", "vllm/vllm_flash_attn/"))
               for folder in GOLDEN["only_cuda_by_folder"])


def test_the_kv_cache_method_branches_on_the_platform_for_rocm_only():
    branches = GOLDEN["platform_branches"]
    assert {line.split(": ", 1)[1] for line in branches["vllm/model_executor/layers/quantization/kv_cache.py"]} == {
        "if current_platform.is_fp8_fnuz():"}
    # a quantization config's minimum capability is checked where a device has one (a CPU has none)
    assert "896: capability_tuple = current_platform.get_device_capability()" in branches["vllm/config/vllm.py"]


def test_docs_state_the_comparison_and_where_it_is_recorded():
    docs = (Path(__file__).parents[1] / "docs" / "engines.md").read_text(encoding="utf-8")
    assert f"of the CPU wheel's {GOLDEN['python_files']['cpu']:,} `.py` files every one is in the CUDA" in docs
    assert "`tests/golden/vllm-cuda-python-0.32.0.json`" in docs and "`probes/vllm_cuda_python.py`" in docs
