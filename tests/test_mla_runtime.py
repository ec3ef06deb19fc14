"""The runtime's MLA path: a paged cache of one latent vector per token, expanded through kv_b_proj to attend."""

from __future__ import annotations

import pytest
import torch

from fp8kv.calibrate.scales import scale_from_amax
from fp8kv.options import DEFAULT_HEADROOM
from fp8kv.checkpoint.load import load_language_model
from fp8kv.errors import Fp8kvError
from fp8kv.tools.zoo import make_zoo_checkpoint
from fp8kv.tools.zoo_matrix import latent_cache_amax
from fp8kv.runtime.latent import LatentPagedCache
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify.accuracy import prefill, token_kl
from fp8kv.verify.fidelity import measure_fidelity

SAMPLES = [list(range(5, 45)), list(range(60, 85))]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_zoo_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla-runtime") / "deepseek_v3")


@pytest.fixture(scope="module")
def bf16(deepseek):
    return PagedModelRunner(deepseek, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2)


def _kl(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([token_kl(torch.log_softmax(x, -1), torch.log_softmax(y, -1)) for x, y in zip(a, b)])


def test_cache_holds_the_latent_transformers_caches(deepseek, bf16) -> None:
    """Per token one vector: transformers' own cache's kv_c_normed then k_pe, bit for bit in a bf16 cache."""
    assert isinstance(bf16.cache, LatentPagedCache)
    assert bf16.cache.pages[0].shape == (bf16.cache.num_pages, 16, 24)
    seq, _ = bf16.start()
    bf16.step([(seq, SAMPLES[0])])
    pages = torch.tensor(bf16.allocator.tables[seq], dtype=torch.int32)
    model = load_language_model(deepseek, torch.device("cpu"))
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([SAMPLES[0]]), use_cache=True).past_key_values
    for layer in (0, 1):
        expected = torch.cat([cache.layers[layer].keys, cache.layers[layer].values], -1)[0, 0]  # [L, 24]
        assert torch.equal(bf16.cache.read(layer, pages, len(SAMPLES[0])), expected.float())
    bf16.free(seq)


def test_bf16_runtime_reproduces_transformers(bf16) -> None:
    fidelity = measure_fidelity(bf16, SAMPLES)
    assert fidelity.reproduces and fidelity.kl_mean <= 1e-6 and fidelity.tokens == sum(map(len, SAMPLES))


def test_decode_steps_read_the_prefix_from_the_cache(deepseek, bf16) -> None:
    """Prefill, then one token per step: each step's logits are transformers' over the whole prefix."""
    tokens = SAMPLES[0][:24]
    seq, _ = bf16.start()
    rows = [bf16.step([(seq, tokens[:20])])[0][-1:]]
    rows += [bf16.step([(seq, [token])])[0] for token in tokens[20:]]
    bf16.free(seq)
    model = load_language_model(deepseek, torch.device("cpu"))
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, 19:].float()
    assert float(_kl([reference], [torch.cat(rows)]).max()) <= 1e-6


def test_fp8_cache_with_calibrated_scales_costs_a_little(deepseek, bf16) -> None:
    amax = latent_cache_amax(deepseek, SAMPLES)
    scales = {layer: float(scale_from_amax(amax[layer][:1], headroom=DEFAULT_HEADROOM)) for layer in amax}
    fp8 = PagedModelRunner(deepseek, device="cpu", cache_dtype="fp8_e4m3", k_scales=scales, v_scales=scales,
                           max_model_len=64, max_num_seqs=2, model=bf16.model)
    assert fp8.cache.pages[0].dtype == torch.float8_e4m3fn
    kl = _kl(prefill(bf16, SAMPLES), prefill(fp8, SAMPLES))
    assert 0.0 < float(kl.mean()) < 1e-4
    counts = fp8.counts()
    assert counts.clamped == {0: (0, 0), 1: (0, 0)} and counts.nonfinite == {0: (0, 0), 1: (0, 0)}
    assert counts.written[0] == sum(map(len, SAMPLES)) * 24
    assert fp8.cache.scale_args(0) == (scales[0], scales[0])


def test_the_latent_cache_counts_the_largest_latent_value_for_k_and_v(deepseek, bf16) -> None:
    # verify reads max |x| / scale on held-out text off these counts: one latent vector, so K's and V's are one
    runner = PagedModelRunner(deepseek, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2,
                              model=bf16.model)
    prefill(runner, SAMPLES)
    expected = latent_cache_amax(deepseek, SAMPLES)
    for layer, (k, v) in runner.counts().amax.items():
        assert k == v == (float(expected[layer][0]),), layer


def test_a_scale_below_the_latent_amax_clamps_and_is_counted(deepseek, bf16) -> None:
    fp8 = PagedModelRunner(deepseek, device="cpu", cache_dtype="fp8_e4m3", k_scales={0: 1e-3, 1: 1e-3},
                           max_model_len=64, max_num_seqs=1, model=bf16.model)
    seq, _ = fp8.start()
    assert torch.isfinite(fp8.step([(seq, SAMPLES[0])])[0]).all()
    clamped = fp8.counts().clamped
    assert clamped[0][0] > 0 and clamped[0][0] == clamped[0][1]


def test_a_hybrid_runs_its_latent_attention_on_a_cache_view(tmp_path) -> None:
    """bailing_hybrid (MLA beside linear-attention layers) runs one sequence per forward: its attention hands
    the cache view kv_c_normed and k_pe, which must land in the latent pages and come back for decode steps."""
    model_dir = make_zoo_checkpoint("bailing_hybrid", tmp_path / "bailing_hybrid")
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2)
    assert runner.cache_view and isinstance(runner.cache, LatentPagedCache)
    tokens = SAMPLES[0][:24]
    seq, _ = runner.start()
    rows = [runner.step([(seq, tokens[:20])])[0][-1:]]
    rows += [runner.step([(seq, [token])])[0] for token in tokens[20:]]
    assert runner.counts().written[runner.geometry.kv_layers[0]] == len(tokens) * runner.cache.latent.width
    runner.free(seq)
    with torch.no_grad():
        reference = runner.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, 19:].float()
    assert float(_kl([reference], [torch.cat(rows)]).max()) <= 1e-6


def test_sparse_attention_is_refused_in_one_line(tmp_path) -> None:
    """DeepSeek V3.2's indexer picks the cached tokens each query attends to: the runtime names it, not a traceback."""
    model_dir = make_zoo_checkpoint("deepseek_v32", tmp_path / "deepseek_v32")
    with pytest.raises(Fp8kvError, match="deepseek_v32: DeepSeek sparse attention"):
        PagedModelRunner(model_dir, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2)


def test_a_latent_gain_before_the_cache_is_applied(tmp_path) -> None:
    """LongCat-Flash multiplies kv_a_layernorm's output by mla_scale_kv_lora before caching it (2.0 here): the
    runtime's latent carries the factor, so its bf16 cache reproduces transformers (without it KL ~7e-4)."""
    model_dir = make_zoo_checkpoint("longcat_flash", tmp_path / "longcat_flash")
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype="bf16", max_model_len=64, max_num_seqs=2)
    assert runner.geometry.kv_layers == (0, 1)
    fidelity = measure_fidelity(runner, SAMPLES)
    assert fidelity.reproduces and fidelity.kl_mean <= 1e-6
