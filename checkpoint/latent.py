"""Which KV-scale conventions can carry the scale of a multi-head latent attention (MLA) cache.

vLLM's MLA layer caches one vector per token, `concat(kv_c_normed, k_pe)`, and quantizes it with the
layer's `_k_scale` alone (`concat_and_cache_mla(..., scale=_k_scale)`); its `_v_scale` is never used.
Its kv-cache quant method (`BaseKVCacheMethod.process_weights_after_loading`) copies a loaded k_scale
into v_scale when only k_scale is present, and uses both when both are. fp8kv writes the latent's one
scale as the layer's `k_scale` and the same value as its `v_scale`: what vLLM would make of k_scale
alone, and the pair compressed-tensors registers on every attention module when transformers loads it.
The DeepSeek loader remaps a checkpoint's `<attention>.k_scale` to `<attention>.attn.k_scale` through
`maybe_remap_kv_scale_name`; that is the scale parameter of its non-MLA attention path, while its MLA
layer keeps the parameter at `<attention>.mla_attn.mla_attn.k_scale`, which no checkpoint name reaches
through that remap, so vLLM (as read, late 2026) warns and runs MLA with 1.0 until its loader maps it.
"""

from __future__ import annotations

from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry

LATENT_CONVENTION = "compressed-tensors"


def check_latent_convention(geometry: AttentionGeometry, convention: str, strategy: str, source: str) -> None:
    """Refuse, in one line, a format or per-head scales an MLA latent cache has no place for."""
    if geometry.latent is None:
        return
    if convention != LATENT_CONVENTION:
        raise Fp8kvError(
            f"{source}: {geometry.model_type} caches one multi-head latent attention (MLA) vector per token; "
            f"only {LATENT_CONVENTION} names its scale (k_scale on the attention module), {convention} has no "
            f"name for it; use --format {LATENT_CONVENTION}"
        )
    if strategy == "attn_head":
        raise Fp8kvError(
            f"{source}: {geometry.model_type} caches one multi-head latent attention (MLA) vector per token, "
            "quantized with one scale per layer; per-head scales do not apply (drop --per-head)"
        )


def check_latent_attention(geometry: AttentionGeometry, attention: str, source: str) -> None:
    """Refuse query scales for MLA: vLLM's MLA decode quantizes the query after folding kv_b_proj into it.

    fp8kv observes the per-head query attention receives (`[.., qk_nope_head_dim + rope]`); vLLM's MLA
    decode quantizes `concat(q_nope @ W_UK, q_pe)` in the latent space, a different tensor.
    """
    if geometry.latent is not None and attention == "fp8":
        raise Fp8kvError(
            f"{source}: --attention fp8: {geometry.model_type}'s multi-head latent attention quantizes its query "
            "in the latent space (after kv_b_proj is folded in), which fp8kv does not observe; calibrate the KV "
            "cache only (--attention kv)"
        )
