"""The TPU path without a TPU: detection through torch_xla.tpu, and the kernel call vLLM's TPU backend makes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.runtime import device as runtime_device  # noqa: E402
from fp8kv.runtime import runner as runtime_runner  # noqa: E402
from fp8kv.runtime.attention import kernel_supported  # noqa: E402
from fp8kv.runtime.device import RuntimeDevice, resolve_device, tpu_version  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402


@pytest.fixture
def torch_xla():
    """torch_xla (the `tpu` extra), imported by the tests that use it, so the others run where it is not installed."""
    import torch_xla

    return torch_xla


def _attach_google_pci_device(monkeypatch) -> None:
    """What a TPU host shows before torch_xla is asked: a PCI device of Google's vendor id."""
    monkeypatch.setattr(runtime_device, "_google_pci_device", lambda: True)


def test_tpu_version_comes_from_torch_xla_tpu(monkeypatch, torch_xla):
    _attach_google_pci_device(monkeypatch)
    monkeypatch.setattr(torch_xla.tpu, "num_available_chips", lambda: 4)
    monkeypatch.setattr(torch_xla.tpu, "version", lambda: 6)
    assert tpu_version() == 6
    monkeypatch.setattr(torch_xla.tpu, "num_available_chips", lambda: 0)
    monkeypatch.setattr(torch_xla.tpu, "version", lambda: pytest.fail("no chips: no metadata query"))
    assert tpu_version() == 0


def test_device_tpu_says_what_is_missing(monkeypatch, torch_xla):
    _attach_google_pci_device(monkeypatch)
    monkeypatch.setattr(torch_xla.tpu, "num_available_chips", lambda: 0)
    with pytest.raises(Fp8kvError, match=r"^device 'tpu' requested but no TPU chips are attached to this host"):
        resolve_device("tpu")
    real_find_spec = importlib.util.find_spec
    for package in ("libtpu", "torch_xla"):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, missing=package: None if name == missing else real_find_spec(name))
        with pytest.raises(Fp8kvError, match=rf"^device 'tpu' requested but {package} is not installed"):
            resolve_device("tpu")
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    monkeypatch.setattr(torch_xla.tpu, "num_available_chips", lambda: 4)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(Fp8kvError, match="^device 'tpu' requested but PJRT_DEVICE=CPU is set"):
        resolve_device("tpu")


@pytest.mark.parametrize(
    "generation,kv_heads,dtype,supported",
    [(6, 2, torch.float8_e4m3fn, True), (6, 8, torch.float8_e4m3fn, True), (6, 16, torch.float8_e4m3fn, True),
     (6, 1, torch.float8_e4m3fn, False), (6, 6, torch.float8_e4m3fn, False), (6, 12, torch.float8_e4m3fn, False),
     (6, 24, torch.float8_e4m3fn, False), (6, 1, torch.bfloat16, True), (6, 3, torch.bfloat16, False),
     (3, 8, torch.float8_e4m3fn, False), (4, 8, torch.bfloat16, True)],
)
def test_kernel_support_follows_the_kernels_head_tiling(generation, kv_heads, dtype, supported):
    assert kernel_supported(generation, kv_heads, dtype) is supported


@pytest.mark.parametrize("arch,windows,cap", [("llama", [None, None], None), ("gemma2", [16, None], 50.0)])
def test_faked_tpu_calls_the_kernel_as_vllm_does(arch, windows, cap, monkeypatch, tmp_path, torch_xla):
    """A TPU v6 faked: auto picks torch_xla's function with use_kernel and static float scales."""
    import torch_xla.experimental.custom_kernel as custom_kernel

    model = make_checkpoint(arch, tmp_path / arch)
    monkeypatch.setattr(runtime_runner, "resolve_device", lambda choice: RuntimeDevice("tpu", torch_xla.device()))
    monkeypatch.setattr(runtime_runner, "tpu_version", lambda: 6)
    calls = []
    reference = custom_kernel.ragged_paged_attention

    def kernel(*args, **kwargs):
        calls.append((args, kwargs))
        return reference(*args, **{**kwargs, "use_kernel": False})  # the Pallas kernel needs a real TPU

    monkeypatch.setattr(custom_kernel, "ragged_paged_attention", kernel)
    scales = {0: 0.05, 1: 0.025}
    tpu = PagedModelRunner(model, device="tpu", cache_dtype="fp8", k_scales=scales, v_scales=scales,
                           page_size=4, max_model_len=32, max_num_seqs=3)
    assert tpu.use_kernel
    prompt = [(7 * i + 11) % 500 + 4 for i in range(9)]
    logits = tpu.step([(tpu.start()[0], prompt)])[0]
    assert tpu.attention == "torch_xla.ragged_paged_attention (Pallas kernel)" and tpu.numerics == "pallas-kernel"
    (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs), kwargs = calls[0]
    assert len(calls) == 2  # one per layer
    assert q.shape == (16, 4, 128) and kv_pages.dtype == torch.float8_e4m3fn and kv_pages.shape[-2:] == (4, 128)
    assert [t.dtype for t in (kv_lens, page_indices, cu_q_lens, num_seqs)] == [torch.int32] * 4
    assert kv_lens.shape == (3,) and page_indices.shape == (3, 8) and cu_q_lens.shape == (4,) and num_seqs.shape == (1,)
    assert kv_lens.cpu().tolist() == [9, 0, 0] and cu_q_lens.cpu().tolist() == [0, 9, 9, 9]
    assert kwargs["use_kernel"] is True and [c[1]["sliding_window"] for c in calls] == windows and kwargs["soft_cap"] == cap
    assert type(kwargs["k_scale"]) is float and type(kwargs["v_scale"]) is float  # static: part of the compile key
    float32 = torch.tensor(0.025).item()  # the cache holds its scales in float32, as a checkpoint stores them
    assert (calls[1][1]["k_scale"], calls[1][1]["v_scale"]) == (float32, float32)
    assert kwargs["sm_scale"] == pytest.approx((16 ** -0.5) if arch == "llama" else tpu.model.config.query_pre_attn_scalar ** -0.5)
    cpu = PagedModelRunner(model, device="cpu", cache_dtype="fp8_e4m3", k_scales=scales, v_scales=scales, page_size=4,
                           max_model_len=32, max_num_seqs=3)
    torch.testing.assert_close(logits, cpu.step([(cpu.start()[0], prompt)])[0], rtol=1e-4, atol=1e-4)


def test_kernel_is_not_used_where_its_heads_do_not_tile(monkeypatch, tmp_path, torch_xla):
    model = make_checkpoint("llama", tmp_path / "llama")
    monkeypatch.setattr(runtime_runner, "resolve_device", lambda choice: RuntimeDevice("tpu", torch_xla.device()))
    monkeypatch.setattr(runtime_runner, "tpu_version", lambda: 6)
    bf16 = PagedModelRunner(model, device="tpu", cache_dtype="bf16", max_model_len=16, max_num_seqs=1)
    assert bf16.use_kernel  # 2 kv heads: 4 combined heads, 2 bf16 words
    monkeypatch.setattr(runtime_runner, "tpu_version", lambda: 3)
    assert not PagedModelRunner(model, device="tpu", cache_dtype="bf16", max_model_len=16, max_num_seqs=1,
                                model=bf16.model).use_kernel
    assert runtime_device.tpu_chips() == 0  # the real host has none


def test_auto_asks_torch_xla_only_where_a_google_pci_device_is_attached(monkeypatch, tmp_path):
    """On a host without TPU chips, `--device auto` never imports torch_xla (seconds) to find that out."""
    monkeypatch.setattr(runtime_device, "PCI_DEVICES", tmp_path)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr(runtime_device.importlib.util, "find_spec", lambda name: object())  # libtpu installed
    (tmp_path / "0000:00:04.0").mkdir()
    (tmp_path / "0000:00:04.0" / "vendor").write_text("0x8086\n")
    assert not runtime_device.may_use_xla("auto") and runtime_device.tpu_chips() == 0
    assert runtime_device.may_use_xla("xla-cpu")
    (tmp_path / "0000:00:05.0").mkdir()
    (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
    assert runtime_device.may_use_xla("auto")

