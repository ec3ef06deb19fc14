"""Tests sized so a plausible runtime bug fails them: a dropped soft-cap, bf16 weights, a bf16 cache that
rounds like e4m3, K and V scales swapped."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from fp8kv.tools.factory import make_checkpoint
from fp8kv.runtime.attention import ragged_paged_attention
from fp8kv.runtime.cache import PagedKVCache
from fp8kv.runtime.runner import PagedModelRunner

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(23)]


@torch.no_grad()
def _eager(model_dir, ids, dtype=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype or "auto").eval()
    return model(torch.tensor([ids])).logits[0].float()


def _run(model_dir, cache_dtype="fp32", **kwargs):
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype=cache_dtype, page_size=4, max_model_len=32,
                              max_num_seqs=1, **kwargs)
    return runner.step([(runner.start()[0], PROMPT)])[0]


def test_gemma2_soft_cap_bites_and_is_applied(tmp_path):
    """q/k weights scaled up so attention scores are far above the cap of 50: the cap changes the output."""
    model_dir = make_checkpoint("gemma2", tmp_path / "gemma2")
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        tensors.update({k: t * 40 for k, t in tensors.items() if k.endswith(("q_proj.weight", "k_proj.weight"))})
        save_file(tensors, file, metadata={"format": "pt"})
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    reference = _eager(model_dir, PROMPT)
    torch.testing.assert_close(_run(model_dir), reference, rtol=1e-4, atol=1e-4)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        uncapped = model(torch.tensor([PROMPT])).logits[0]
    # a runner that dropped the cap would be this far off: 100x the tolerance above
    assert (uncapped - reference).abs().max() > 1e-2


def test_bf16_weights_run_and_track_eager(tmp_path):
    model_dir = make_checkpoint("qwen3", tmp_path / "qwen3", dtype=torch.bfloat16)
    logits = _run(model_dir, cache_dtype="bf16")
    reference = _eager(model_dir, PROMPT)
    assert (logits - reference).abs().max() < 2e-2 * reference.abs().max()
    assert logits.argmax(-1).eq(reference.argmax(-1)).float().mean() > 0.9


def test_bf16_cache_is_not_secretly_e4m3(tmp_path):
    """The tolerance separates a bf16 cache (8 bits of mantissa) from an e4m3 one (4)."""
    model_dir = make_checkpoint("llama", tmp_path / "llama")
    reference = _eager(model_dir, PROMPT)
    bf16 = (_run(model_dir, cache_dtype="bf16") - reference).abs().max()
    e4m3 = (_run(model_dir, cache_dtype="fp8_e4m3") - reference).abs().max()  # unit scales: pure e4m3 rounding
    tolerance = 4 * bf16
    assert bf16 < tolerance < e4m3


def test_k_and_v_scales_are_not_swapped_on_write_or_read():
    k_scale, v_scale = 0.1 / 448, 10.0 / 448
    cache = PagedKVCache([0], num_pages=3, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float8_e4m3fn,
                         device=torch.device("cpu"), k_scales={0: k_scale}, v_scales={0: v_scale})
    g = torch.Generator().manual_seed(0)
    k = torch.rand(6, 1, 8, generator=g) * 0.2 - 0.1  # |K| <= 0.1, |V| <= 10: each fills its scale's range
    v = torch.rand(6, 1, 8, generator=g) * 20 - 10
    cache.write(0, k, v, torch.arange(4, 10), torch.ones(6, dtype=torch.bool))
    q = torch.randn(6, 2, 8, generator=g) * 30
    ks, vs = cache.scale_args(0)
    out = ragged_paged_attention(q, cache.layer_pages(0), torch.tensor([6], dtype=torch.int32),
                                 torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32),
                                 torch.tensor([1], dtype=torch.int32), sm_scale=1.0, k_scale=ks, v_scale=vs)
    scores = torch.einsum("qhd,khd->hqk", q, k.expand(6, 2, 8)).masked_fill(torch.ones(6, 6).triu(1).bool(), -1e9)
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.expand(6, 2, 8))
    # the cache holds float32 scales, which is also the precision attention multiplies in
    assert (ks, vs) == tuple(torch.tensor([k_scale, v_scale]).tolist())
    torch.testing.assert_close(out, dense, rtol=0.1, atol=0.6)  # e4m3 rounding of |V| <= 10: about 6 %
