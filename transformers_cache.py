"""transformers' KV cache as fp8kv's stages use it: the cache class a model defines, an empty one, the
forward keywords that hand it over, K/V heads broadcast before the cache, and which layers keep a
recurrent state instead of K/V.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fp8kv.errors import Fp8kvError


def model_cache_class(model: Any) -> type:
    """The DynamicCache subclass the model's own file defines (one at most), else DynamicCache."""
    from transformers import DynamicCache

    module = sys.modules[type(model).__module__]
    own = [c for c in vars(module).values()
           if isinstance(c, type) and issubclass(c, DynamicCache) and c.__module__ == module.__name__]
    return own[0] if len(own) == 1 else DynamicCache


def new_cache(cache_class: type, model: Any) -> Any:
    """An empty `cache_class` for `model`: built from its config where the class takes one (DynamicCache
    then lays out Mamba and linear-attention layers), else bare (MiniMax's own cache)."""
    takes_config = "config" in inspect.signature(cache_class.__init__).parameters
    return cache_class(config=model.config) if takes_config else cache_class()


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The forward keywords that hand `cache` to `model`: `cache=` (newer models) or `past_key_values=`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def fold_repeated_heads(states: torch.Tensor, kv_heads: int, where: str) -> torch.Tensor:
    """[batch, heads, seq, head_dim] whose head h repeats KV head h // (heads / kv_heads) -> [batch, kv_heads, seq, head_dim].

    Falcon's new decoder architecture (Falcon-40B, -180B, Falcon2) hands its cache K and V already broadcast
    to every query head; vLLM caches the KV heads, so the copies fold back, checked to be exact copies.
    """
    heads = states.shape[1]
    grouped = states.unflatten(1, (kv_heads, heads // kv_heads)) if heads % kv_heads == 0 else None
    if grouped is None or not torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)):
        raise Fp8kvError(f"{where}: the cache update got {heads} K/V heads that are not copies of the config's "
                         f"{kv_heads} KV heads; fp8kv cannot tell which heads an engine would cache")
    return grouped[:, :, 0]


def recurrent_layers(layer_types: Sequence[str]) -> list[int]:
    """Layers whose transformers cache layer keeps a recurrent state (Mamba, linear attention), not K/V."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin

    return [i for i, kind in enumerate(layer_types)
            if issubclass(DYNAMIC_LAYER_TYPE_MAPPING.get(kind, object), LinearAttentionCacheLayerMixin)]
