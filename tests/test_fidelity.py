"""verify's bf16 runtime against transformers' own forward: measured, and refused when it is not the model."""

from __future__ import annotations

import pytest

from fp8kv.checks import FAIL, WARN
from fp8kv.tools.factory import make_checkpoint
from fp8kv.runtime import runner as runner_module
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify.fidelity import MIN_BOUND, measure_fidelity
from fp8kv.verify.results import Fidelity

SAMPLES = [list(range(5, 53)), list(range(60, 100))]  # both longer than the factory's sliding window (16)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_checkpoint("mistral", tmp_path_factory.mktemp("fidelity") / "mistral")


def _runner(path) -> PagedModelRunner:
    return PagedModelRunner(path, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2)


def test_the_runtime_reproduces_transformers_on_a_sliding_window_model(mistral):
    result = measure_fidelity(_runner(mistral), SAMPLES)
    assert (result.samples, result.tokens) == (2, 88)
    assert result.reproduces and not result.refuses and result.reasons() == []
    assert abs(result.kl_mean) < 1e-6 and result.noise is not None and result.bound == MIN_BOUND


def test_a_runtime_that_ignores_the_sliding_window_is_refused(mistral, monkeypatch):
    attend = runner_module.ragged_paged_attention
    monkeypatch.setattr(runner_module, "ragged_paged_attention",
                        lambda *args, sliding_window, **kwargs: attend(*args, sliding_window=None, **kwargs))
    result = measure_fidelity(_runner(mistral), SAMPLES)
    assert result.refuses and result.kl_mean > 10 * MIN_BOUND
    [finding] = result.reasons()
    assert finding.level == FAIL and "\n" not in finding.message
    assert finding.message.startswith(f"verify's bf16 runtime does not reproduce transformers on this model: "
                                      f"mean KL {result.kl_mean:.2e} against transformers' own forward exceeds "
                                      f"the bound {MIN_BOUND:.1e};")


def test_a_model_with_one_attention_implementation_only_warns():
    fidelity = Fidelity(kl_mean=2 * MIN_BOUND, kl_max=1e-4, noise=None, bound=MIN_BOUND, samples=2, tokens=88)
    [finding] = fidelity.reasons()
    assert finding.level == WARN and not fidelity.refuses and "one attention implementation" in finding.message
    noisy = Fidelity(kl_mean=2e-4, kl_max=1e-3, noise=1e-4, bound=4e-4, samples=2, tokens=88)
    assert noisy.reproduces and noisy.reasons() == []  # within 4x the model's own rounding noise
