"""The paged cache for models that compute attention in their own code (falcon, bloom, mpt, gpt_neo).

Those models never call transformers' AttentionInterface, so the paged attention function cannot
run inside them. Every one of them hands its K/V to the cache object it is given, though, and attends
over what `update` returns. `sequence_cache` is such a cache for one sequence in one step: `update`
quantizes the new K/V into the sequence's pages, as the attention function does, and returns the
sequence's whole K/V read back from the pages (dequantized). The model then attends over exactly
what the fp8 cache holds, with its own masks, ALiBi and softmax. Sequences run one per forward:
the model's own attention has no notion of several sequences packed into one row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8kv.runtime.attention import gather_kv
from fp8kv.runtime.cache import PagedKVCache


def sequence_cache(cache: PagedKVCache, num_layers: int, past: int, slots: torch.Tensor, pages: Sequence[int]):
    """A transformers `Cache` over `cache` for one sequence: `past` cached tokens, new tokens at `slots` `[T]`,
    its page table `pages`."""
    from transformers.cache_utils import Cache, DynamicLayer

    class PagedSequenceLayer(DynamicLayer):
        """One layer: `update` writes the new K/V into the pages and returns the sequence's K/V from them."""

        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            # [1, kv_heads, T, d] -> [T, kv_heads, d]
            k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            owner = cache.owner(self.layer)
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
            self.is_initialized = True
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.keys.shape[-2] if self.is_initialized else past

    return Cache(layers=[PagedSequenceLayer(layer) for layer in range(num_layers)])
