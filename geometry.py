"""The attention geometry of a checkpoint, derived once from its config.json through transformers' config class."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.errors import Fp8kvError

@dataclass(frozen=True)
class LatentCache:
    """What a multi-head latent attention (MLA: DeepSeek V2/V3 and descendants) layer caches per token.

    One vector `concat(kv_c_normed, k_pe)`: the compressed latent after `kv_a_layernorm` (`kv_lora_rank`
    values) and the rope key after RoPE, shared by all heads (`qk_rope_head_dim` values). Attention
    expands it through `kv_b_proj` into per-head K_nope (`qk_nope_head_dim`) and V (`v_head_dim`).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def width(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, text: Any, source: str) -> LatentCache | None:
        """The latent layout of an MLA config (one with `kv_lora_rank`), else None; one for all layers."""
        layouts = {cls._of_layer(layer, source)
                   for layer in _per_layer_configs(text, _positive_int(text, "num_hidden_layers", source))}
        if len(layouts) > 1:
            raise Fp8kvError(f"{source}: its layers cache multi-head latent attention (MLA) vectors of different "
                             f"layouts {sorted(map(str, layouts))}; fp8kv handles one latent layout per model")
        return layouts.pop()

    @classmethod
    def _of_layer(cls, layer: Any, source: str) -> LatentCache | None:
        if getattr(layer, "kv_lora_rank", None) is None:
            return None
        keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        for key in keys:
            if getattr(layer, key, None) is None:
                raise Fp8kvError(f"{source}: '{key}' is missing; a multi-head latent attention (MLA) config "
                                 "with kv_lora_rank needs it")
        return cls(*(_positive_int(layer, key, source) for key in keys))


@dataclass(frozen=True)
class AttentionGeometry:
    """What the KV cache of a decoder looks like, layer by layer, as transformers reads config.json.

    `layer_types[i]` is transformers' name for layer i ("full_attention", "sliding_attention",
    "linear_attention", ...). `kv_layers` are the layers that own a K/V cache, in order; only those
    get scales. `kv_heads_per_layer` / `head_dim_per_layer` give each layer's cached K/V shape where
    layers differ (Gemma 4 global layers); `num_kv_heads` / `head_dim` are the largest over `kv_layers`.
    `latent` is set for multi-head latent attention: each cache layer then holds one vector per token
    (1 "KV head" of `latent.width`).
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    kv_layers: tuple[int, ...]
    kv_heads_per_layer: tuple[int, ...] = ()
    head_dim_per_layer: tuple[int, ...] = ()
    # (layer, source): the layer attends over the K/V cache of the earlier layer `source` (KV sharing)
    shared_kv_sources: tuple[tuple[int, int], ...] = ()
    # multi-head latent attention: every cache layer stores one latent vector per token, not K and V
    latent: LatentCache | None = None
    # V's head_dim where it differs from K's (MiMo-V2-Flash: 192 for K, 128 for V); None: the same
    v_head_dim: int | None = None

    @property
    def head_dims(self) -> frozenset[int]:
        """The head_dims the K/V cache layers store."""
        return frozenset(self.layer_head_dim(layer) for layer in self.kv_layers)

    @property
    def skipped_layers(self) -> tuple[int, ...]:
        """Layers that own no K/V cache (linear attention, Mamba, KV sharing)."""
        return tuple(i for i in range(self.num_layers) if i not in self.kv_layers)

    def layer_kv_heads(self, layer: int) -> int:
        """KV heads layer `layer` caches."""
        return self.kv_heads_per_layer[layer] if self.kv_heads_per_layer else self.num_kv_heads

    def layer_head_dim(self, layer: int) -> int:
        """head_dim of the K/V layer `layer` caches."""
        return self.head_dim_per_layer[layer] if self.head_dim_per_layer else self.head_dim

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> AttentionGeometry:
        """Build the geometry from a config.json dictionary, read through transformers' config class.

        The config class applies its attribute maps (gpt2's n_layer, n_head), its defaults and its
        derived fields (multi-query KV heads, per-layer overrides), exactly as the model will see them.
        """
        whole = config_object(config, source)
        text = whole.get_text_config(decoder=True)
        if not hasattr(text, "to_dict"):  # transformers hands back whatever a stray `text_config` key holds
            raise Fp8kvError(f"{source}: 'text_config' must be an object, not {type(text).__name__}")
        stored = _stored_text(config, whole, text, source)
        _refuse_unsupported(whole, text, source)
        _require_keys(stored, text, ("num_hidden_layers", "num_attention_heads", "hidden_size"), source)
        model_type = str(getattr(text, "model_type", "") or config.get("model_type") or "")
        num_layers = _positive_int(text, "num_hidden_layers", source)
        per_layer = _per_layer_configs(text, num_layers)
        # heterogeneous configs (Gemma 4) hold sizes per layer; the first layer's are the model's
        num_heads = _positive_int(per_layer[0], "num_attention_heads", source)
        hidden_size = _positive_int(per_layer[0], "hidden_size", source)
        kinds, owns_cache = cache_layout(text, num_layers, source)
        latent = LatentCache.from_config(text, source)
        if latent is None:
            kv_heads = tuple(_kv_heads(layer, num_heads, source) for layer in per_layer)
            head_dims = tuple(_head_dim(layer, hidden_size, num_heads, source) for layer in per_layer)
            kv_heads, head_dims = _sliding_layer_sizes(text, kv_heads, head_dims, source)
        else:  # the latent is one "head" of width kv_lora_rank + qk_rope_head_dim
            kv_heads, head_dims = (1,) * num_layers, (latent.width,) * num_layers
        kv_layers = tuple(i for i in range(num_layers) if owns_cache[i])
        if not kv_layers and getattr(text, "num_kv_shared_layers", 0) == num_layers:
            raise Fp8kvError(f"{source}: every layer attends over another model's K/V (num_kv_shared_layers = "
                             "num_hidden_layers, a speculative-decoding assistant): it owns no K/V cache to scale")
        if not kv_layers:
            raise Fp8kvError(f"{source}: no layer owns a K/V cache (layer types {sorted(set(kinds))})")
        for i in kv_layers:
            if num_heads % kv_heads[i]:
                raise Fp8kvError(
                    f"{source}: num_attention_heads={num_heads} is not a multiple of "
                    f"num_key_value_heads={kv_heads[i]} (layer {i})"
                )
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=max(kv_heads[i] for i in kv_layers),
            head_dim=max(head_dims[i] for i in kv_layers),
            hidden_size=hidden_size,
            vocab_size=_optional_int(text, "vocab_size", source),
            layer_types=kinds,
            sliding_window=_optional_int(text, "sliding_window", source) or None,
            kv_layers=kv_layers,
            kv_heads_per_layer=kv_heads,
            head_dim_per_layer=head_dims,
            shared_kv_sources=_shared_kv_sources(text, num_layers, source),
            latent=latent,
            v_head_dim=None if latent else _optional_int(text, "v_head_dim", source) or None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> AttentionGeometry:
        """Read `model_dir/config.json` and build the geometry."""
        return cls.from_config(read_config(model_dir), source=str(Path(model_dir) / "config.json"))


def config_object(config: dict[str, Any], source: str = "config.json"):
    """transformers' config class instance for a config.json dictionary (its attribute maps applied).

    An unknown model_type (a model with its own code) falls back to the generic `PretrainedConfig`.
    """
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise Fp8kvError(f"{source}: 'model_type' must be a string, found {model_type!r}")
    cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else PretrainedConfig
    try:
        # as from_pretrained reads config.json: special floats (Infinity) are stored as {"__float__": ...}
        return cls.from_dict(cls._decode_special_floats(dict(config)))
    except Exception as exc:  # the config class validates with its own exception types (strict dataclasses)
        reason = str(exc).strip().splitlines()[-1].strip()
        raise Fp8kvError(f"{source}: transformers' {cls.__name__} rejects it: {reason[:300]}") from None


def text_config(config: dict[str, Any], source: str = "config.json"):
    """The decoder's config (the language model of a multimodal config), as a transformers config object."""
    return config_object(config, source).get_text_config(decoder=True)


def cache_layout(text: Any, num_layers: int, source: str) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """Per layer: transformers' layer type and whether its DynamicCache layer stores K/V.

    Uses transformers' own table (the one DynamicCache builds its layers from), so Mamba, linear
    attention, MoE-only and KV-sharing ("reuse") layers are told apart the way the model does.
    """
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer, get_layer_types_and_kwargs

    try:
        kinds, _ = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError) as exc:
        raise Fp8kvError(f"{source}: cannot read the layer types ({exc})") from None
    kinds = tuple(str(kind) for kind in kinds)
    if len(kinds) != num_layers:
        raise Fp8kvError(f"{source}: 'layer_types' must list {num_layers} layers, found {len(kinds)}")
    owns = tuple(
        isinstance(DYNAMIC_LAYER_TYPE_MAPPING.get(kind), type) and issubclass(DYNAMIC_LAYER_TYPE_MAPPING[kind], DynamicLayer)
        for kind in kinds
    )
    return kinds, owns


def _shared_kv_sources(text: Any, num_layers: int, source: str) -> tuple[tuple[int, int], ...]:
    """(layer, source) for each layer that reads an earlier layer's cache, from transformers' `kv_sharing_modes`.

    A "reuse" layer (Gemma 3n, Gemma 4) attends over the K/V its model hands over by layer type: those
    of the last earlier "store" layer of the same type.
    """
    try:
        modes = getattr(text, "kv_sharing_modes", None) or [None] * num_layers
    except ValueError as exc:  # the config class checks that every sharing layer type has a producer
        raise Fp8kvError(f"{source}: cannot read the KV sharing layout ({exc})") from None
    types = list(getattr(text, "layer_types", None) or [None] * num_layers)
    pairs = []
    for layer, mode in enumerate(modes):
        if mode != "reuse":
            continue
        stores = [i for i in range(layer) if modes[i] == "store" and types[i] == types[layer]]
        if not stores:
            raise Fp8kvError(f"{source}: layer {layer} reuses the K/V cache of an earlier {types[layer]} layer, "
                             "but no earlier layer of that type stores one")
        pairs.append((layer, stores[-1]))
    return tuple(pairs)


def _stored_text(config: dict[str, Any], whole: Any, text: Any, source: str) -> dict[str, Any]:
    """The part of config.json the decoder's config was read from (`text_config`, musicgen's `decoder`, or all)."""
    for name in getattr(whole, "sub_configs", {}):
        if getattr(whole, name, None) is text and name in config:
            if not isinstance(config[name], dict):
                raise Fp8kvError(f"{source}: '{name}' must be an object")
            return config[name]
    return config


def _require_keys(raw: dict[str, Any], text: Any, keys: tuple[str, ...], source: str) -> None:
    """The config class would fill a missing size with its default; a checkpoint must state it.

    A size the config class derives from other keys (nemotron_h's layer count from its layer pattern) is stated.
    """
    stored_as = getattr(text, "attribute_map", {})  # e.g. gpt2: num_hidden_layers is stored as n_layer
    for key in keys:
        if isinstance(getattr(type(text), key, None), property):
            continue
        if key not in raw and stored_as.get(key) not in raw:
            if key == "num_attention_heads" and not hasattr(text, key):
                raise Fp8kvError(f"{source}: {text.model_type} has no attention layers, so no K/V cache to scale")
            raise Fp8kvError(f"{source}: '{key}' is missing")


def _per_layer_configs(text: Any, num_layers: int) -> list[Any]:
    """Each layer's config: transformers' per-layer views for heterogeneous configs, else the config itself."""
    if not getattr(text, "is_heterogeneous", False):
        return [text] * num_layers
    return list(text.per_layer_config)


# Architectures whose cache holds something other than one K/V pair per decoder layer (or nothing), or whose
# decoder does not read text, by model_type: what stops fp8kv.
_AUDIO_CODES = ("its decoder reads and predicts num_codebooks parallel streams of audio codes conditioned on a text "
                "encoder, not text, so text calibration data does not exercise it")
_UNSUPPORTED = {
    "musicgen": _AUDIO_CODES,
    "musicgen_melody": _AUDIO_CODES,
    "openai-gpt": "its transformers model keeps no KV cache (its forward takes none), so no scale would apply",
    "deepseek_v4": "each layer caches one shared K=V head over a sliding window plus compressed entries for older "
                   "tokens (compressor states), which fp8kv neither observes nor verifies",
    "reformer": "its cache holds each layer's hidden states and LSH bucket ids, not K/V",
    "xlnet": "it keeps a memory of hidden states (mems), not a K/V cache",
    "blt": "it runs three transformer stacks (a byte-level local encoder and local decoder, each caching its K/V "
           "in its own cache from layer 0, and an uncached patch-level global transformer), while a checkpoint has "
           "one scale per layer index",
    "hrm_text": "each decoder layer runs in several recurrent cycles, each caching its K/V under its own cache "
                "slot, while a checkpoint has one scale per layer",
}


def _refuse_unsupported(whole: Any, text: Any, source: str) -> None:
    model_type = getattr(whole, "model_type", None)
    model_type = model_type if model_type in _UNSUPPORTED else getattr(text, "model_type", None)
    if model_type in _UNSUPPORTED:
        raise Fp8kvError(f"{source}: {model_type} is not supported: {_UNSUPPORTED[model_type]}")
    cross = [i for i in getattr(text, "cross_attention_layers", None) or () if i < getattr(text, "num_hidden_layers", 0)]
    if cross:
        raise Fp8kvError(
            f"{source}: cross-attention layers {cross} are not supported: they cache K/V of the image (the vision "
            "encoder's output), which calibration on text never produces"
        )
    if getattr(text, "recurrent_kv_cache_mode", None) == "per_loop" and getattr(text, "n_recurrent_layers", 0):
        raise Fp8kvError(
            f"{source}: recurrent_kv_cache_mode 'per_loop' is not supported: each loop over the recurrent layers "
            "caches its K/V in extra cache layers after the model's own, while a checkpoint has one scale per layer"
        )
    if getattr(text, "is_encoder_decoder", False) or getattr(whole, "is_encoder_decoder", False):
        raise Fp8kvError(
            f"{source}: {whole.model_type} is an encoder-decoder model: its decoder also caches cross-attention "
            "K/V of the encoder output, which fp8kv neither observes nor verifies"
        )
    if getattr(text, "is_decoder", None) is False and _attends_bidirectionally(text):
        raise Fp8kvError(
            f"{source}: is_decoder is false: transformers runs this {text.model_type} as a bidirectional encoder, "
            "which keeps no K/V cache; a causal LM built from it sets is_decoder: true"
        )


def _attends_bidirectionally(text: Any) -> bool:
    """Whether transformers' model of `text` (is_decoder false) runs its self-attention bidirectionally.

    Many config classes carry an `is_decoder` flag (GPT-NeoX's defaults it to false), but only encoder
    families (BERT, RoBERTa, RoFormer, ...) read it: their layers copy it and attend causally only when it
    is true. The model is built on the meta device (no weights) and asked; one transformers cannot build
    keeps the flag's word.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
    except Exception:  # an unmapped or unbuildable config: trust the flag
        return True
    return any(getattr(module, "is_decoder", None) is False for module in model.modules())


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """Load config.json as a dictionary, with one clear error for each way it can be wrong."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise Fp8kvError(f"{path}: not found; a Hugging Face checkpoint folder needs a config.json")
    return read_json(path)


def read_json(path: Path) -> dict[str, Any]:
    """A small JSON file that must hold an object, with one clear error otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8kvError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise Fp8kvError(f"{path}: must hold a JSON object, found {type(data).__name__}")
    return data


def _positive_int(config: Any, key: str, source: str, default: int | None = None) -> int:
    value = getattr(config, key, None)
    value = default if value is None else value
    if value is None:
        raise Fp8kvError(f"{source}: '{key}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Fp8kvError(f"{source}: '{key}' must be a positive integer, found {value!r}")
    return value


def _optional_int(config: Any, key: str, source: str) -> int:
    """An optional count (0 when absent or null); anything but a non-negative integer is an error."""
    value = getattr(config, key, None) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Fp8kvError(f"{source}: '{key}' must be a non-negative integer, found {value!r}")
    return value


def _kv_heads(config: Any, num_heads: int, source: str) -> int:
    """KV heads: num_key_value_heads (the config classes derive it for multi-query models), else all heads."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1  # Falcon-7B style multi-query attention ignores num_kv_heads
    for key in ("num_key_value_heads", "num_kv_heads"):
        if getattr(config, key, None) is not None:
            return _positive_int(config, key, source)
    return num_heads


# Sliding-window layers whose attention code multiplies the config's KV heads (MiMo-V2-Flash doubles them).
_SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}


def _sliding_layer_sizes(text: Any, kv_heads: tuple[int, ...], head_dims: tuple[int, ...],
                         source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """KV heads and head_dim per layer, with the sizes the model's sliding-window layers use where they differ.

    Inkling states them as swa_num_key_value_heads / swa_head_dim; MiMo-V2-Flash's attention code
    doubles the KV heads of its sliding layers.
    """
    types = list(getattr(text, "layer_types", None) or ())
    sliding = [i for i, kind in enumerate(types) if kind in ("sliding_attention", "hybrid_sliding")]
    factor = _SLIDING_KV_HEADS_FACTOR.get(text.model_type, 1)
    if not sliding or (factor == 1 and getattr(text, "swa_num_key_value_heads", None) is None):
        return kv_heads, head_dims
    heads, dims = list(kv_heads), list(head_dims)
    for i in sliding:
        if getattr(text, "swa_num_key_value_heads", None) is not None:
            heads[i] = _positive_int(text, "swa_num_key_value_heads", source)
            dims[i] = _positive_int(text, "swa_head_dim", source, default=dims[i])
        heads[i] *= factor
    return tuple(heads), tuple(dims)


def _head_dim(config: Any, hidden_size: int, num_heads: int, source: str) -> int:
    if getattr(config, "head_dim", None) is not None:
        return _positive_int(config, "head_dim", source)
    if hidden_size % num_heads:
        raise Fp8kvError(
            f"{source}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads} "
            "and no head_dim is given"
        )
    return hidden_size // num_heads
