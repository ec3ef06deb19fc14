"""Multi-head latent attention (DeepSeek V2/V3 and descendants): the latent cache vLLM keeps, observed exactly.

vLLM's MLA cache stores one vector per token and layer, `concat(kv_c_normed, k_pe)`, quantized with the
layer's one k_scale. fp8kv must observe that vector (not the per-head K/V attention expands it into),
with the same scale formula as every other layer.
"""

from __future__ import annotations

import pytest
import torch

from fp8kv.geometry import AttentionGeometry, LatentCache
from fp8kv.models.zoo import make_zoo_checkpoint
from fp8kv.models.zoo_matrix import latent_cache_amax

SAMPLES = [list(range(5, 45)), list(range(60, 85)), list(range(100, 131))]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_zoo_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla") / "deepseek_v3")


def test_geometry_caches_one_latent_vector_per_layer(deepseek) -> None:
    geometry = AttentionGeometry.from_dir(deepseek)
    assert geometry.latent == LatentCache(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    assert geometry.latent.width == 24
    assert (geometry.kv_layers, geometry.num_kv_heads, geometry.head_dim) == ((0, 1), 1, 24)
    assert [geometry.layer_kv_heads(i) for i in (0, 1)] == [1, 1]


def test_an_mla_config_without_rope_width_is_refused(tmp_path) -> None:
    from fp8kv.errors import Fp8kvError
    from fp8kv.geometry import text_config

    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
              "kv_lora_rank": 16}
    with pytest.raises(Fp8kvError, match=r"^cfg: 'qk_rope_head_dim' is missing; a multi-head latent attention "
                                         r"\(MLA\) config with kv_lora_rank needs it$"):
        LatentCache.from_config(text_config(config), "cfg")


def test_latent_amax_equals_the_models_own_latent_exactly(deepseek) -> None:
    """kv_a_layernorm's output and the rope key after RoPE, read with hooks, against fp8kv's statistics."""
    from fp8kv.checkpoint.load import load_language_model
    from fp8kv.data import make_batches
    from fp8kv.observe import K, V, observe

    geometry = AttentionGeometry.from_dir(deepseek)
    model = load_language_model(deepseek, torch.device("cpu"), "auto")
    statistics = observe(model, make_batches(SAMPLES, 1, 0), geometry)
    reference = latent_cache_amax(deepseek, SAMPLES)
    assert sorted(reference) == [0, 1]
    for layer in (0, 1):
        assert float(statistics.amax[layer, K, 0]) == float(reference[layer][0]) > 0
        assert float(statistics.amax[layer, V, 0]) == float(reference[layer][0])
        assert int(statistics.tokens[layer]) == sum(map(len, SAMPLES))
        # every cached value of the latent (width 24) was counted once per slot
        assert int(statistics.hist[layer, K, 0].sum()) == sum(map(len, SAMPLES)) * 24


def test_padding_is_not_observed_in_the_latent(deepseek) -> None:
    """A right-padded batch folds only real tokens: the amax equals the unpadded run's."""
    from fp8kv.checkpoint.load import load_language_model
    from fp8kv.data import make_batches
    from fp8kv.observe import observe

    geometry = AttentionGeometry.from_dir(deepseek)
    model = load_language_model(deepseek, torch.device("cpu"), "auto")
    padded = observe(model, make_batches(SAMPLES, 3, 0), geometry)
    assert padded.tokens.tolist() == [sum(map(len, SAMPLES))] * 2
    assert int(padded.hist[0, 0, 0].sum()) == sum(map(len, SAMPLES)) * 24
