"""The runtime report names the attention that ran, from counted calls, and a TPU never falls back silently."""

from __future__ import annotations

from dataclasses import replace
import json
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate  # noqa: E402
from fp8kv.data import DataRequest  # noqa: E402
from fp8kv.engine_models import RELEASED  # noqa: E402
from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.tools.zoo import make_zoo_checkpoint  # noqa: E402
from fp8kv.runtime import runner as runtime_runner  # noqa: E402
from fp8kv.runtime.attention import TORCH, XLA_KERNEL, XLA_REFERENCE  # noqa: E402
from fp8kv.runtime.cache_view import CACHE_VIEW  # noqa: E402
from fp8kv.runtime.device import RuntimeDevice  # noqa: E402
from fp8kv.runtime.latent import LATENT  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402
from fp8kv.runtime.xla_cost import summarize  # noqa: E402
from fp8kv.verify import accuracy as verify_accuracy  # noqa: E402
from fp8kv.verify import run as verify_run  # noqa: E402
from fp8kv.verify.request import VerifyRequest  # noqa: E402
from fp8kv.verify.run import verify  # noqa: E402
from fp8kv.verify.tpu import tpu_kernel_reasons  # noqa: E402

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(9)]
SCALES = {0: 0.05, 1: 0.05}


def _run(model_dir, **kwargs):
    runner = PagedModelRunner(model_dir, cache_dtype="fp8_e4m3", k_scales=SCALES, v_scales=SCALES, page_size=4,
                              max_model_len=32, max_num_seqs=2, **kwargs)
    assert runner.attention == "none" and not runner.calls  # nothing is assumed before a call
    runner.step([(runner.start()[0], PROMPT)])
    return runner


@pytest.mark.parametrize("model_type,name", [("falcon", CACHE_VIEW), ("bloom", CACHE_VIEW), ("deepseek_v3", LATENT)])
def test_models_attending_outside_the_paged_function_report_what_ran(model_type, name, tmp_path):
    model_dir = make_zoo_checkpoint(model_type, tmp_path / model_type)
    for device in ("cpu", "xla-cpu"):  # on XLA the report used to say torch_xla, with no call to torch_xla
        runner = _run(model_dir, device=device)
        summary = summarize(runner, PROMPT[:4], 0 if device == "xla-cpu" else None)
        calls = 2 if device == "cpu" else 2 + 4 * 2  # on XLA summarize runs two prefills and two decodes more
        assert (summary.attention, summary.attention_calls, summary.use_kernel) == (name, {name: calls}, False)
        assert summary.attention_numerics == "bfloat16"  # the model's own arithmetic, in its dtype, not fp8kv's
    with pytest.raises(Fp8kvError, match="only the ragged paged attention reproduces another arithmetic"):
        _run(model_dir, device="cpu", attention_numerics="pallas-kernel")


def test_engine_attention_names_the_arithmetic_a_model_attending_in_its_own_code_keeps(tmp_path):
    text = _text(tmp_path)
    src = make_zoo_checkpoint("bloom", tmp_path / "bloom")
    data = DataRequest(str(text), num_samples=2, seq_len=16)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "calibrated", data=data, batch_size=2))
    result = verify(VerifyRequest(tmp_path / "calibrated", data=data, batch_size=2, num_prompts=1, prompt_len=8,
                                  new_tokens=2, device="cpu", report_dir=tmp_path / "report",
                                  engines=("vllm-cuda", "vllm-tpu"), engine_attention=True))
    # vllm-tpu would attend as the Pallas kernel does, but bloom's own attention code runs for every engine
    assert {e.engine: e.attention for e in result.report.held_out.engines} == {"vllm-cuda@0.34.0": "bfloat16",
                                                                               "vllm-tpu@0.10.1.1": "bfloat16"}
    notes = [r.message for r in result.report.reasons if r.level == "INFO" and "--engine-attention" in r.message]
    assert notes == ["--engine-attention: bloom attends in its own code or over MLA latents, so every engine model "
                     "attends in bfloat16 here and only its write is its own"]


def test_the_paged_function_reports_torch_or_torch_xla_by_calls(tmp_path):
    model_dir = make_checkpoint("llama", tmp_path / "llama")
    assert dict(_run(model_dir, device="cpu").calls) == {TORCH: 2}  # one call per layer
    xla = _run(model_dir, device="xla-cpu")
    assert dict(xla.calls) == {XLA_REFERENCE: 2} and xla.attention == XLA_REFERENCE
    assert summarize(xla, PROMPT[:4], 0).attention_calls == {XLA_REFERENCE: 10}


def _fake_tpu(monkeypatch):
    """A TPU v6 faked on XLA:CPU; the kernel is stood in for by torch_xla's reference (it needs a real TPU)."""
    import torch_xla
    import torch_xla.experimental.custom_kernel as custom_kernel

    tpu = RuntimeDevice("tpu", torch_xla.device())
    for module in (runtime_runner, verify_run, verify_accuracy):
        monkeypatch.setattr(module, "resolve_device", lambda choice, torch_only=False: tpu)
    monkeypatch.setattr(runtime_runner, "tpu_version", lambda: 6)
    reference = custom_kernel.ragged_paged_attention
    monkeypatch.setattr(custom_kernel, "ragged_paged_attention",
                        lambda *args, **kwargs: reference(*args, **{**kwargs, "use_kernel": False}))


@pytest.mark.parametrize("kv_heads,tiles", [(2, True), (8, True), (3, False), (6, False)])
def test_on_a_tpu_heads_that_do_not_tile_fail_vllm_tpu_naming_the_rule(kv_heads, tiles, monkeypatch, tmp_path):
    _fake_tpu(monkeypatch)
    model_dir = make_checkpoint("llama", tmp_path / "llama", num_heads=kv_heads * 2, num_kv_heads=kv_heads,
                                hidden_size=kv_heads * 32)
    runner = _run(model_dir, device="tpu")
    reasons = tpu_kernel_reasons("tpu", runner.geometry, runner.calls, ("vllm-cuda@0.34.0", "vllm-tpu@0.10.1.1"))
    if tiles:
        assert dict(runner.calls) == {XLA_KERNEL: 2} and reasons == []
        return
    assert dict(runner.calls) == {XLA_REFERENCE: 2}
    assert [r.level for r in reasons] == ["FAIL"]
    assert reasons[0].message.startswith(
        f"engine vllm-tpu@0.10.1.1: num_key_value_heads={kv_heads}: torch_xla 2.9's Pallas kernel (vLLM's torch_xla TPU "
        "backend) needs the combined K/V heads 2*num_kv_heads divisible by 4 for an fp8 cache, with 2*kv/4 in "
        "{1, 2, 4, 8} or a multiple of 8")
    assert "(per chip under tensor parallelism)" in reasons[0].message
    assert reasons[0].message.endswith(f"verify ran {XLA_REFERENCE} (2 calls) instead of the kernel, so its numbers "
                                       "are not that engine's")
    assert tpu_kernel_reasons("xla-cpu", runner.geometry, runner.calls, ("vllm-tpu",)) == []  # no TPU: no claim
    assert tpu_kernel_reasons("tpu", runner.geometry, runner.calls, ("vllm-cuda",)) == []  # vllm-tpu not judged


def _text(tmp_path):
    from pydoc_data.topics import topics

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": topics[k][:300]}) + "\n" for k in sorted(topics)[40:44]))
    return text


def test_verify_on_a_tpu_fails_vllm_tpu_for_heads_that_do_not_tile(monkeypatch, tmp_path):
    text = _text(tmp_path)
    src = make_checkpoint("llama", tmp_path / "src", num_heads=6, num_kv_heads=3, hidden_size=96)
    data = DataRequest(str(text), num_samples=2, seq_len=16)
    calibrate(CalibrationRequest(model=str(src), out=tmp_path / "calibrated", data=data, batch_size=2))
    _fake_tpu(monkeypatch)
    request = VerifyRequest(tmp_path / "calibrated", data=data, batch_size=2, num_prompts=1, prompt_len=8,
                            new_tokens=2, device="tpu", report_dir=tmp_path / "report", engines=("vllm-tpu@0.10.1.1",))
    result = verify(request)
    assert result.verdict == "FAIL"
    failed = [r.message for r in result.report.reasons if r.level == "FAIL"]
    assert len(failed) == 1 and failed[0].startswith("engine vllm-tpu@0.10.1.1: num_key_value_heads=3: ")
    # the kernel's head rule is that one engine's: judging today's releases, it decides nothing
    released = verify(replace(request, engines=RELEASED, report_dir=tmp_path / "released"))
    assert not any("num_key_value_heads=3" in r.message for r in released.report.reasons if r.level != "INFO")
    runtime = result.report.held_out.runtime
    assert runtime.attention == XLA_REFERENCE and runtime.use_kernel is False
