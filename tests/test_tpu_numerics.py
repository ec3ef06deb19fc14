"""The runner with the TPU's attention arithmetic on a bf16 checkpoint, against torch_xla's function on XLA:CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(23)]
SCALES = {0: 0.01, 1: 0.01}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("bf16") / "llama", dtype=torch.bfloat16, head_dim=128,
                           hidden_size=256)


def _logits(model_dir, **kwargs):
    runner = PagedModelRunner(model_dir, cache_dtype="fp8_e4m3", k_scales=SCALES, v_scales=SCALES, page_size=4,
                              max_model_len=32, max_num_seqs=1, **kwargs)
    return runner, runner.step([(runner.start()[0], PROMPT)])[0]


def test_runner_rounds_attention_to_the_query_dtype_only_when_asked(bf16_llama, tmp_path):
    """With "xla-reference" a bf16 model's attention rounds to bf16 (other logits); a float32 model's is unchanged."""
    float32_llama = make_checkpoint("llama", tmp_path / "f32", head_dim=128, hidden_size=256)
    for model_dir, differs in ((bf16_llama, True), (float32_llama, False)):
        outs = {}
        for numerics in ("float32", "xla-reference"):
            runner, outs[numerics] = _logits(model_dir, device="cpu", attention_numerics=numerics)
            assert runner.numerics == numerics
        assert torch.equal(outs["float32"], outs["xla-reference"]) is not differs


def test_xla_backend_refuses_numerics_it_does_not_run(bf16_llama):
    with pytest.raises(Fp8kvError, match="attention numerics 'float32': torch_xla's function runs 'xla-reference' "
                                         "here; choose the torch attention backend"):
        PagedModelRunner(bf16_llama, device="xla-cpu", attention_numerics="float32", max_model_len=8, max_num_seqs=1)
    with pytest.raises(Fp8kvError, match="unknown attention numerics 'bf16'"):
        PagedModelRunner(bf16_llama, device="cpu", attention_numerics="bf16", max_model_len=8, max_num_seqs=1)
