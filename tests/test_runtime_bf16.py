"""A bf16 checkpoint runs in bf16: a runner that upcast its weights to float32 fails here.

Where a query attends to its own key alone (the first token of each sequence) the softmax is exactly 1 and the
paged attention returns V unchanged, so there the runner's logits are transformers' own bf16 forward bit for bit,
while transformers' float32 forward of the same weights differs by about 1e-3 (on logits of about 0.7).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402

PROMPTS = [[(7 * i + 11) % 500 + 4 for i in range(23)], [(13 * i + 5) % 500 + 4 for i in range(9)],
           [(3 * i + 40) % 500 + 4 for i in range(14)]]


@torch.no_grad()
def _transformers_logits(model_dir, dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    return [model(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_a_bf16_checkpoint_runs_in_bf16(arch, tmp_path):
    model_dir = make_checkpoint(arch, tmp_path / arch, dtype=torch.bfloat16)
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype="bf16", page_size=4, max_model_len=32,
                              max_num_seqs=len(PROMPTS))
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    logits = runner.step([(runner.start()[0], ids) for ids in PROMPTS])  # one packed bf16 forward
    bf16, float32 = _transformers_logits(model_dir, torch.bfloat16), _transformers_logits(model_dir, torch.float32)
    for ours, theirs, upcast in zip(logits, bf16, float32):
        assert torch.equal(ours, ours.to(torch.bfloat16).float())  # the forward ended in bf16
        assert torch.equal(ours[0], theirs[0])  # a query alone with its key: transformers' bf16 forward exactly
        assert (upcast[0] - theirs[0]).abs().max() > 1e-3  # what a float32 forward of these weights gives instead
        scale = theirs.abs().max()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-2 * scale)


def test_a_step_hands_over_the_models_own_logits_when_asked(tmp_path):
    """verify's scorer converts a few rows at a time, so its prefills take the bf16 logits as the model made them."""
    model_dir = make_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype="bf16", page_size=4, max_model_len=32,
                              max_num_seqs=len(PROMPTS))

    def prefill(**dtype):
        seqs = [runner.start()[0] for _ in PROMPTS]
        logits = runner.step(list(zip(seqs, PROMPTS)), **dtype)
        for seq in seqs:
            runner.free(seq)
        return logits

    default, own = prefill(), prefill(logits_dtype=None)
    for as_float, as_made in zip(default, own):
        assert as_float.dtype == torch.float32 and as_made.dtype == torch.bfloat16
        assert torch.equal(as_made.float(), as_float)


def test_a_bf16_checkpoint_stays_bf16_on_xla(tmp_path):
    model_dir = make_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    scales = {0: 0.05, 1: 0.05}
    runner = PagedModelRunner(model_dir, device="xla-cpu", cache_dtype="fp8_e4m3", k_scales=scales, v_scales=scales,
                              page_size=4, max_model_len=32, max_num_seqs=1)
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    logits = runner.step([(runner.start()[0], PROMPTS[0])])[0]
    assert torch.equal(logits, logits.to(torch.bfloat16).float())  # the forward ended in bf16 on XLA too
