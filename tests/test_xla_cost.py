"""Native fp8 on XLA: a warm fp8 decode step costs what a bf16 one does (no CPU fallbacks, no extra transfers)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner, load_model  # noqa: E402
from fp8kv.runtime.xla_cost import warm_decode_step  # noqa: E402

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(5)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model_dir = make_checkpoint("llama", tmp_path_factory.mktemp("m") / "llama", num_layers=2)
    return model_dir, load_model(model_dir, __import__("torch_xla").device())


def _cost(llama, cache_dtype, backend):
    model_dir, model = llama
    scales = {i: 0.05 for i in range(2)} if cache_dtype.startswith("fp8") else None
    runner = PagedModelRunner(model_dir, device="xla-cpu", cache_dtype=cache_dtype, k_scales=scales, v_scales=scales,
                              page_size=4, max_model_len=16, max_num_seqs=2, attention_backend=backend, model=model)
    return warm_decode_step(runner, PROMPT)


def test_fp8_decode_on_xla_has_no_cpu_fallbacks(llama):
    bf16, fp8 = _cost(llama, "bf16", "torch"), _cost(llama, "fp8_e4m3", "torch")
    assert fp8.cpu_fallbacks == bf16.cpu_fallbacks == 0
    assert fp8.device_to_host <= bf16.device_to_host
    assert fp8.compiles == bf16.compiles == 0  # warm: the same shapes run again


def test_fp8_costs_what_bf16_costs_through_torch_xlas_function(llama):
    """torch_xla's reference reads lengths on the host (`_local_scalar_dense`); fp8 adds nothing to that."""
    bf16, fp8 = _cost(llama, "bf16", "auto"), _cost(llama, "fp8_e5m2", "auto")
    assert fp8.cpu_fallbacks == bf16.cpu_fallbacks
    assert fp8.device_to_host <= bf16.device_to_host
    assert fp8.compiles == bf16.compiles == 0
