"""Query scales for fp8 attention: calibrated on Q as the kernel reads it, written, read back, used by the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from fp8kv.data import DataRequest, load_calibration_data
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.checkpoint.conventions import ATTENTION_GROUP
from fp8kv.checkpoint.convert import convert_checkpoint
from fp8kv.inspection import inspect_checkpoint
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.errors import Fp8kvError
from fp8kv.runtime.runner import PagedModelRunner

E4M3_MAX = 448.0


def query_amax(model_dir: Path, samples: list[list[int]]) -> torch.Tensor:
    """Independent reference: max |Q| per layer recomputed from each attention's inputs (q_proj, q_norm, RoPE)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    layers = model.model.layers
    amax = torch.zeros(len(layers))

    def capture(index: int):
        def hook(module, args, kwargs):
            hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
            q = module.q_norm(module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            amax[index] = torch.maximum(amax[index], q.abs().amax().float())
        return hook

    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
    with torch.no_grad():
        for sample in samples:
            model(input_ids=torch.tensor([sample]))
    return amax


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, factory_checkpoint, corpus: str) -> tuple[Path, Path, list]:
    """A qwen3 (q_norm) factory model calibrated with --attention fp8, right-padded batches of 4."""
    src = factory_checkpoint("qwen3")
    out = tmp_path_factory.mktemp("q") / "out"
    request = CalibrationRequest(model=str(src), out=out, data=DataRequest(corpus, num_samples=6, seq_len=60),
                                 batch_size=4, attention="fp8", device="cpu", headroom=1.0)
    calibrate(request)
    samples = load_calibration_data(request.data, AutoTokenizer.from_pretrained(src)).samples
    return src, out, samples


def test_q_scale_is_the_amax_of_q_after_q_norm_and_rope(calibrated) -> None:
    src, out, samples = calibrated
    scales = read_kv_scales(out).scales
    assert scales is not None and scales.q is not None
    expected = query_amax(src, samples) / E4M3_MAX  # headroom 1.0: amax / 448
    got = torch.tensor([scales.q[i] for i in scales.layers])
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    recorded = json.loads((out / "fp8kv.json").read_text())["query_scales"]
    assert [row["q_scale"] for row in recorded] == got.tolist()
    assert all(row["q_amax"] <= row["q_scale"] * E4M3_MAX for row in recorded)  # nothing observed saturates


def test_q_scale_is_written_as_compressed_tensors_attention_scheme(calibrated) -> None:
    _, out, _ = calibrated
    config = json.loads((out / "config.json").read_text())
    qc = config["compression_config"]  # a KV-only block: transformers ignores this key, vLLM reads it
    assert "quantization_config" not in config
    group = qc["config_groups"][ATTENTION_GROUP]
    assert group["targets"] == ["Qwen3Attention"] and group["weights"] is None
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                          "symmetric": True}
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    names = sorted(SourceCheckpoint.open(out).weight_map)
    assert "model.layers.0.self_attn.q_scale" in names and "model.layers.1.self_attn.q_scale" in names
    rows = inspect_checkpoint(out).layers
    assert all(row.q_scale > 0 for row in rows)


def test_convert_keeps_q_scale_in_compressed_tensors_and_drops_it_elsewhere(calibrated, tmp_path: Path) -> None:
    _, out, _ = calibrated
    same = read_kv_scales(convert_checkpoint(out, tmp_path / "ct", "compressed-tensors")).scales
    assert same is not None and same.q is not None
    assert same.q == read_kv_scales(out).scales.q
    modelopt = read_kv_scales(convert_checkpoint(out, tmp_path / "mo", "modelopt")).scales
    assert modelopt is not None and modelopt.q is None


def test_runtime_quantizes_q_only_when_asked(calibrated) -> None:
    src, out, samples = calibrated
    scales = read_kv_scales(out).scales
    q = {i: scales.q_value(i) for i in scales.layers}
    logits = {}
    for name, q_scales in (("plain", None), ("fp8 q", q), ("tiny q_scale", {i: 1e-6 for i in q})):
        runner = PagedModelRunner(out, device="cpu", cache_dtype="bf16", max_model_len=64, q_scales=q_scales)
        seq, _ = runner.start()
        logits[name] = runner.step([(seq, samples[0])])[0]
    near = (logits["fp8 q"] - logits["plain"]).abs().max()
    assert 0 < near < 0.1 * logits["plain"].abs().max()
    assert (logits["tiny q_scale"] - logits["plain"]).abs().max() > near  # clamped Q: attention goes wrong
    with pytest.raises(Fp8kvError, match=r"q_scales cover layers \[0\]; give one per KV layer \[0, 1\]"):
        PagedModelRunner(out, device="cpu", q_scales={0: 1.0})


def test_attention_fp8_needs_compressed_tensors(factory_checkpoint, corpus: str, tmp_path: Path) -> None:
    request = CalibrationRequest(model=str(factory_checkpoint("llama")), out=tmp_path / "o", attention="fp8",
                                 convention="modelopt", data=DataRequest(corpus, num_samples=2, seq_len=20))
    with pytest.raises(Fp8kvError, match="--attention fp8 writes q_scale, which only the compressed-tensors"):
        calibrate(request)
    assert not (tmp_path / "o").exists()


def test_verify_reports_the_cost_of_quantizing_q(calibrated, corpus: str, tmp_path: Path) -> None:
    from fp8kv.verify.request import VerifyRequest
    from fp8kv.verify.run import verify

    _, out, _ = calibrated
    common = dict(data=DataRequest(corpus, num_samples=4, seq_len=48), batch_size=4, num_prompts=2, prompt_len=8,
                  new_tokens=2, device="cpu")
    plain = verify(VerifyRequest(out, report_dir=tmp_path / "plain", **common)).report
    asked = verify(VerifyRequest(out, report_dir=tmp_path / "q", quantize_query=True, **common)).report
    assert plain.held_out.query is None
    assert "query" not in json.loads((tmp_path / "plain" / "report.json").read_text())
    query = asked.held_out.query
    assert query.kl_mean_kv_only == plain.held_out.accuracy.kl_mean
    assert query.kl_mean > 0 and query.kl_mean != query.kl_mean_kv_only
    assert 0 <= query.top1_agreement <= 1
    assert "## Query quantized with q_scale (fp8 attention)" in (tmp_path / "q" / "report.md").read_text()


def test_lm_eval_model_reads_q_as_fp8_when_asked(calibrated) -> None:
    from lm_eval.api.instance import Instance

    from fp8kv.evaluation.harness import Fp8kvLM
    from fp8kv.evaluation.spec import CacheSpec

    _, out, _ = calibrated
    request = [Instance("loglikelihood", {}, ("The for statement", " is used to iterate"), 0)]
    scores = {query: Fp8kvLM(str(out), quantize_query=query, device="cpu").loglikelihood(request, disable_tqdm=True)
              for query in (False, True)}
    assert scores[True][0][0] != scores[False][0][0]
    assert CacheSpec.parse("fp8", "checkpoint", "vllm-tpu", query=True).label == "fp8 checkpoint vllm-tpu@0.10.1.1 + fp8 Q"
    with pytest.raises(Fp8kvError, match="quantize_query needs kv_cache=fp8 and scales=checkpoint"):
        CacheSpec.parse("fp8", "unit", "vllm-tpu", query=True)
