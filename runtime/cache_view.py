"""The paged cache seen as a transformers cache, for models the attention function cannot run inside.

Two kinds of model run this way, one sequence per forward:
- models that compute attention in their own code (falcon, bloom, mpt, gpt_neo) and never call
  transformers' AttentionInterface;
- hybrids whose Mamba or linear-attention layers carry a recurrent state from step to step, which
  must stay apart per sequence (packed into one row, one sequence's state leaks into the next).

Every one of them hands its K/V to the cache object it is given and attends over what `update`
returns. `sequence_cache` is such a cache for one sequence in one step: `update` quantizes the new
K/V into the sequence's pages, as the attention function does, and returns the sequence's whole K/V
read back from the pages (dequantized), so the model attends over exactly what the fp8 cache holds,
with its own masks, ALiBi and softmax. A hybrid's recurrent layers stay transformers' own, in a cache
object the runner keeps per sequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from fp8kv.transformers_cache import fold_repeated_heads
from fp8kv.errors import Fp8kvError
from fp8kv.runtime.attention import gather_kv
from fp8kv.runtime.cache import PagedKVCache
from fp8kv.runtime.latent import LatentPagedCache

# What the runtime report names when the model's own attention code read the pages, one count per layer call.
CACHE_VIEW = "the model's own attention over fp8kv.cache_view"


def sequence_cache(cache: PagedKVCache, attention_layers: Sequence[int], past: int, slots: torch.Tensor,
                   pages: Sequence[int], calls: Counter[str], state: Any = None) -> Any:
    """A transformers `Cache` over `cache` for one sequence: `past` cached tokens, new tokens at `slots` `[T]`,
    its page table `pages`. Each `update` is counted in `calls` under `CACHE_VIEW`. `state`: the sequence's own
    transformers cache holding its recurrent layers (hybrids), whose attention layers are replaced; None builds
    a cache of `attention_layers` only."""
    from transformers.cache_utils import Cache, DynamicLayer

    class PagedSequenceLayer(DynamicLayer):
        """One attention layer: `update` writes the new K/V into the pages and returns the sequence's K/V."""

        def __init__(self, layer: int) -> None:
            # DynamicLayer's own initialiser, not the model's layer class's (which may take arguments, e.g. a
            # sliding window): what that class keeps is copied over from the layer this one replaces
            DynamicLayer.__init__(self)
            self.layer = layer

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            calls[CACHE_VIEW] += 1
            if isinstance(cache, LatentPagedCache):
                return self._update_latent(key_states, value_states)
            owner = cache.owner(self.layer)
            kv_heads, heads = cache.layer_kv_heads(owner), key_states.shape[1]
            if heads > kv_heads:  # K/V broadcast to every query head (new-architecture Falcon): cache the KV heads
                key_states, value_states = (fold_repeated_heads(x, kv_heads, f"layer {self.layer}")
                                            for x in (key_states, value_states))
            # [1, kv_heads, T, d] -> [T, kv_heads, d]
            k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            if k.shape[0] != slots.shape[0]:  # cpmant prepends its own prompt tokens; xlm expects the whole sequence
                raise Fp8kvError(f"layer {self.layer}: the model cached K/V of {k.shape[0]} tokens for "
                                 f"{slots.shape[0]} new ones (it adds tokens of its own or re-reads the whole "
                                 "sequence each step); the paged runtime feeds each step's new tokens only")
            if owner == self.layer:
                cache.write(owner, k, v, slots, torch.ones_like(slots, dtype=torch.bool))
            length = past + k.shape[0]
            table = torch.tensor([list(pages)], dtype=torch.int32, device=slots.device)
            lens = torch.tensor([length], dtype=torch.int32, device=slots.device)
            keys, values = gather_kv(cache.layer_pages(owner), table, lens, *cache.scale_args(owner))
            head_dim = cache.layer_head_dim(owner)
            # [1, L, kv_heads, D] -> [1, kv_heads, length, head_dim] in the model's dtype
            self.keys, self.values = (x[:, :length, :, :head_dim].transpose(1, 2).to(key_states.dtype)
                                      for x in (keys, values))
            if heads > kv_heads:  # handed back as the model broadcast them
                self.keys, self.values = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (self.keys, self.values))
            self.is_initialized = True
            return self.keys, self.values

        def _update_latent(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor):
            # MLA hands its cache the latent, kv_c_normed [1, 1, T, rank] and k_pe [1, 1, T, rope], not K/V
            vectors = torch.cat([kv_c_normed, k_pe.to(kv_c_normed.dtype)], -1)[0, 0]  # [T, width]
            cache.write(self.layer, vectors, slots, torch.ones_like(slots, dtype=torch.bool))
            table = torch.tensor(list(pages), dtype=torch.int32, device=slots.device)
            stored = cache.read(self.layer, table, past + vectors.shape[0]).to(kv_c_normed.dtype)
            self.keys, self.values = (x[None, None] for x in stored.split([kv_c_normed.shape[-1], k_pe.shape[-1]], -1))
            self.is_initialized = True
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.keys.shape[-2] if self.is_initialized else past

        # The K/V it returns are the whole sequence's, whatever window the model's own layer class keeps
        get_mask_sizes = DynamicLayer.get_mask_sizes

    if state is None:
        return Cache(layers=[PagedSequenceLayer(layer) for layer in attention_layers])
    own = vars(DynamicLayer()).keys() | {"layer"}
    for layer in attention_layers:
        while len(state.layers) <= layer:  # caches that add their layers lazily (MiniMax's)
            state.layers.append(DynamicLayer())
        # the model's own layer class, and what it keeps besides K/V (an indexer's keys and positions), carry over
        replaced = state.layers[layer]
        own_class = next(c for c in type(replaced).__mro__ if c.__module__ != __name__)
        paged = type("PagedSequenceLayer", (PagedSequenceLayer, own_class), {"__module__": __name__})(layer)
        paged.__dict__.update({k: v for k, v in vars(replaced).items() if k not in own})
        state.layers[layer] = paged
    return state
