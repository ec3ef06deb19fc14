"""Attention sinks (gpt-oss) and chunked attention (llama4) in the runner, against transformers' eager forward."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402

PROMPT = [(7 * i + 11) % 200 + 4 for i in range(21)]


def _save(config, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def _gpt_oss(path):
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=128)
    model_dir = _save(config, path)
    from safetensors.torch import load_file, save_file

    # Sinks large enough to matter: they take a visible share of every softmax.
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        tensors.update({k: torch.full_like(t, 2.0) for k, t in tensors.items() if k.endswith("sinks")})
        save_file(tensors, file, metadata={"format": "pt"})
    return model_dir


def _llama4(path):
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=2, attention_chunk_size=8, no_rope_layers=[1, 0],
                              max_position_embeddings=128)
    return _save(config, path)


@torch.no_grad()
def _eager(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return model, model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("build", [_gpt_oss, _llama4], ids=["gpt-oss sinks", "llama4 chunked"])
def test_runner_matches_eager_with_the_feature(build, tmp_path):
    model_dir = build(tmp_path / "model")
    eager, reference = _eager(model_dir, PROMPT)
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype="fp32", page_size=4, max_model_len=32, max_num_seqs=2)
    seq, _ = runner.start()
    prefill = runner.step([(seq, PROMPT[:13])])[0]
    decode = [runner.step([(seq, [t])])[0] for t in PROMPT[13:]]
    torch.testing.assert_close(torch.cat([prefill, *decode]), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build,feature", [(_gpt_oss, "attention sinks"), (_llama4, "chunked attention")])
def test_torch_xla_attention_refuses_the_feature(build, feature, tmp_path):
    model_dir = build(tmp_path / "model")
    runner = PagedModelRunner(model_dir, device="xla-cpu", cache_dtype="bf16", page_size=4, max_model_len=16,
                              max_num_seqs=1)
    with pytest.raises(Fp8kvError, match=f"^{feature} .* is not supported by torch_xla's ragged_paged_attention$"):
        runner.step([(runner.start()[0], PROMPT[:9])])
