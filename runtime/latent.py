"""The paged latent cache of multi-head latent attention (MLA: DeepSeek V2/V3 and descendants).

As vLLM's MLA cache: one vector per token and layer, `concat(kv_c_normed, k_pe)` (the latent after
`kv_a_layernorm`, then the rope key after RoPE), quantized with the layer's k_scale. Attention reads
a sequence's vectors back, dequantizes them, expands the latent through the layer's own `kv_b_proj`
into per-head K_nope and V (the model's `expand_kv`), appends the rope key to every head and attends.

The model's attention module hands the attention function only the expanded K/V of the new tokens;
the rope key is the rope slice of that K (the same k_pe on every head), and `kv_c_normed` is caught
by a forward hook on `kv_a_layernorm` (`capture_latents`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.engine_models import DEFAULT_ENGINE, EngineModel, as_engine_model
from fp8kv.fp8 import is_fp8, nonfinite, to_float32
from fp8kv.geometry import LatentCache
from fp8kv.runtime.cache import PagedLayers, Scale, layer_scales, page_slots, shadow_differences, shadow_models

# The attention module attribute that holds the current forward's kv_c_normed `[1, T, kv_lora_rank]`.
_CAPTURED = "fp8kv_kv_c_normed"
# What the runtime report names for `latent_attention`, one count per call.
LATENT = "fp8kv.latent_attention"


class LatentPagedCache(PagedLayers):
    """One `[num_pages, page_size, width]` tensor per MLA layer, written with the layer's k_scale.

    Exposes what verify reads of `PagedKVCache`: `scales` float32 `[layers, 2, 1]` (the file's k_scale
    and v_scale; only k_scale quantizes, as in vLLM's MLA layer), `scale_args`, and the counters of
    `PagedLayers`, whose K and V slots both count the one latent vector.
    """

    def __init__(
        self,
        kv_layers: Sequence[int],
        *,
        latent: LatentCache,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        k_scales: Mapping[int, Scale] | None = None,
        v_scales: Mapping[int, Scale] | None = None,
        engine: str | EngineModel = DEFAULT_ENGINE,
        shadows: Sequence[str | EngineModel] = (),
    ) -> None:
        kv_layers = tuple(kv_layers)
        super().__init__(kv_layers, [torch.zeros(num_pages, page_size, latent.width, dtype=dtype, device=device)
                                     for _ in kv_layers], device, [1] * len(kv_layers))
        self.latent = latent
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.engine = as_engine_model(engine)
        self.shadows = shadow_models(self.engine, shadows)
        k_scales, v_scales = self.engine.loads(k_scales, v_scales)
        k_given = layer_scales(k_scales, kv_layers, [1] * len(kv_layers), "k_scale")
        v_given = layer_scales(v_scales, kv_layers, [1] * len(kv_layers), "v_scale")
        self.scales = torch.tensor([[k, v] for k, v in zip(k_given, v_given)], dtype=torch.float32).to(device)
        self._k_floats = [k[0] for k in k_given]

    def owner(self, layer: int) -> int:
        """MLA layers own their cache (no KV sharing)."""
        return layer

    def layer_kv_heads(self, layer: int) -> int:
        """One latent vector per token: one "head" (the width of the scale table's rows)."""
        return 1

    def write(self, layer: int, vectors: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Quantize and store `vectors` `[T, width]` at flat `slots` `[T]`; `valid` `[T]` marks real tokens."""
        row = self._row[layer]
        scale = self.scales[row, 0]
        stored = self.engine.write(vectors, scale, self.dtype) if is_fp8(self.dtype) else vectors.to(self.dtype)
        mask = valid[:, None]
        magnitude = torch.where(mask, vectors.float().abs(), 0.0)  # [T, width]
        self._fold_amax(row, magnitude.max().expand(2, 1))  # one vector: K's and V's slot alike
        if is_fp8(self.dtype):
            over = magnitude / scale > torch.finfo(self.dtype).max
            self.clamped[row] += over.sum()
            if self.forward is not None:
                self.forward.over.add_(over.sum(1))
        self.nonfinite[row] += (nonfinite(stored) & mask).sum()
        self.written[row] += valid.sum() * self.latent.width
        if self.forward is not None and self.shadows and is_fp8(self.dtype):
            self.forward.shadow_diffs.add_(shadow_differences(self.shadows, vectors, scale, stored, mask))
        self._store(row, slots, stored)

    def read(self, layer: int, pages: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` vectors of a sequence whose page table is `pages` `[pages_per_seq]`, dequantized (float32)."""
        row = self._row[layer]
        positions = torch.arange(length, device=pages.device)
        stored = to_float32(self._load(row, page_slots(pages, positions, self.page_size)))
        return stored * self.scales[row, 0] if is_fp8(self.dtype) else stored

    def scale_args(self, layer: int) -> tuple[float | None, float | None]:
        """(k_scale, v_scale) as held for the layer (floats), None for a non-fp8 cache."""
        if not is_fp8(self.dtype):
            return None, None
        row = self._row[layer]
        return self._k_floats[row], float(self.scales[row, 1])


def latent_gain(module: torch.nn.Module) -> float:
    """The factor an MLA attention module multiplies `kv_a_layernorm`'s output by before caching it: Dots 3's
    `kv_lora_scale`, LongCat-Flash's `mla_scale_kv_lora`; 1 for DeepSeek and most others."""
    for name in ("kv_lora_scale", "mla_scale_kv_lora"):
        if hasattr(module, name):
            return float(getattr(module, name))
    return 1.0


def capture_latents(model: torch.nn.Module) -> None:
    """Hook each MLA attention module's `kv_a_layernorm` once, keeping its output for the attention function.

    Refuses DeepSeek sparse attention: its indexer restricts each query to its top-k cached tokens, a
    selection (and an indexer key cache) the paged latent attention does not compute.
    """
    for module in model.modules():
        if getattr(module, "indexer", None) is not None:
            raise Fp8kvError(f"{model.config.model_type}: DeepSeek sparse attention (an indexer choosing the top-k "
                             "cached tokens each query attends to) is not modelled by the verify runtime")
        norm = getattr(module, "kv_a_layernorm", None)
        if norm is None or not hasattr(module, "layer_idx") or hasattr(module, _CAPTURED):
            continue
        setattr(module, _CAPTURED, None)
        norm.register_forward_hook(
            lambda _, __, out, owner=module, gain=latent_gain(module): setattr(owner, _CAPTURED, out * gain))


def latent_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, cache: LatentPagedCache,
                     meta: Any, scaling: float, calls: Counter[str]) -> torch.Tensor:
    """Write the step's latents, then attend over each sequence's cached latents: `[1, T, heads, v_head_dim]`.

    `query` `[1, heads, T, qk_head_dim]`, `key` `[1, heads, T, qk_head_dim]` (the expanded K of the new
    tokens); `meta` is the runner's `StepMetadata` (slots, kv_lens, page_indices, cu_q_lens, num_seqs). The call
    is counted in `calls` under `LATENT`.
    """
    calls[LATENT] += 1
    layer, latent = module.layer_idx, cache.latent
    kv_c_normed = getattr(module, _CAPTURED).reshape(-1, latent.kv_lora_rank)  # [T, kv_lora_rank]
    setattr(module, _CAPTURED, None)
    k_pe = key[0, 0, :, latent.qk_nope_head_dim:]  # [T, rope]: the rope key, the same on every head
    cache.write(layer, torch.cat([kv_c_normed, k_pe.to(kv_c_normed.dtype)], -1), meta.slot_mapping, meta.valid)
    heads, tokens = query.shape[1], query.shape[2]
    out = query.new_zeros(tokens, heads, latent.v_head_dim)
    bounds, lengths = meta.cu_q_lens.tolist(), meta.kv_lens.tolist()
    for s in range(int(meta.num_seqs[0])):
        start, end, length = bounds[s], bounds[s + 1], lengths[s]
        vectors = cache.read(layer, meta.page_indices[s], length).to(query.dtype)  # [L, width]
        kv_nope, k_rot = vectors.split([latent.kv_lora_rank, latent.qk_rope_head_dim], -1)
        k, v = module.expand_kv(kv_nope.view(1, 1, length, -1), k_rot.view(1, 1, length, -1))  # [1, H, L, d]
        positions = torch.arange(length - (end - start), length, device=query.device)  # the new tokens, causal
        mask = torch.arange(length, device=query.device)[None, :] <= positions[:, None]  # [q, L]
        attended = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], k, v, attn_mask=mask, scale=scaling)  # [1, H, q, v_head_dim]
        out[start:end] = attended[0].transpose(0, 1)
    return out.unsqueeze(0)
