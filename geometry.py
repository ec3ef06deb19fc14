"""The attention geometry of a checkpoint, derived once from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv.errors import Fp8kvError

# Layer types in transformers' `layer_types` that own a K/V cache.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class AttentionGeometry:
    """What the KV cache of a decoder looks like, layer by layer.

    `layer_types[i]` is transformers' name for layer i ("full_attention",
    "sliding_attention", "linear_attention", ...). `kv_layers` are the layers
    that own a K/V cache, in order; only those get scales.
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

    @property
    def skipped_layers(self) -> tuple[int, ...]:
        """Layers that own no K/V cache (linear attention, Mamba, KV sharing)."""
        return tuple(i for i in range(self.num_layers) if i not in self.kv_layers)

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> AttentionGeometry:
        """Build the geometry from a config.json dictionary (multimodal configs use `text_config`)."""
        text = config.get("text_config") or config
        if not isinstance(text, dict):
            raise Fp8kvError(f"{source}: 'text_config' must be an object")
        if text.get("kv_lora_rank") is not None or config.get("kv_lora_rank") is not None:
            raise Fp8kvError(
                f"{source}: multi-head latent attention (MLA, kv_lora_rank) is not supported: "
                "its cache stores a latent vector, not per-head K and V"
            )
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        num_layers = _positive_int(text, "num_hidden_layers", source)
        num_heads = _positive_int(text, "num_attention_heads", source)
        num_kv_heads = _positive_int(text, "num_key_value_heads", source, default=num_heads)
        hidden_size = _positive_int(text, "hidden_size", source)
        head_dim = _head_dim(text, hidden_size, num_heads, source)
        if num_heads % num_kv_heads:
            raise Fp8kvError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        layer_types = _layer_types(text, num_layers, source)
        shared = _optional_int(text, "num_kv_shared_layers", source)
        owners = [i for i, kind in enumerate(layer_types) if kind in ATTENTION_LAYER_TYPES]
        # KV-sharing layers (Gemma 3n) are the last ones; they read an earlier layer's cache.
        kv_layers = tuple(i for i in owners if i < num_layers - shared)
        if not kv_layers:
            raise Fp8kvError(f"{source}: no layer owns a K/V cache (layer_types={list(layer_types)})")
        window = _optional_int(text, "sliding_window", source)
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden_size,
            vocab_size=_optional_int(text, "vocab_size", source),
            layer_types=layer_types,
            sliding_window=window or None,
            kv_layers=kv_layers,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> AttentionGeometry:
        """Read `model_dir/config.json` and build the geometry."""
        return cls.from_config(read_config(model_dir), source=str(Path(model_dir) / "config.json"))


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


def _positive_int(config: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise Fp8kvError(f"{source}: '{key}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Fp8kvError(f"{source}: '{key}' must be a positive integer, found {value!r}")
    return value


def _optional_int(config: dict[str, Any], key: str, source: str) -> int:
    """An optional count (0 when absent or null); anything but a non-negative integer is an error."""
    value = config.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Fp8kvError(f"{source}: '{key}' must be a non-negative integer, found {value!r}")
    return value


def _head_dim(config: dict[str, Any], hidden_size: int, num_heads: int, source: str) -> int:
    if config.get("head_dim") is not None:
        return _positive_int(config, "head_dim", source)
    if hidden_size % num_heads:
        raise Fp8kvError(
            f"{source}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads} "
            "and no head_dim is given"
        )
    return hidden_size // num_heads


def _layer_types(config: dict[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        uses_window = config.get("sliding_window") and config.get("use_sliding_window", True)
        kind = "sliding_attention" if uses_window else "full_attention"
        return (kind,) * num_layers
    if not isinstance(types, list) or len(types) != num_layers or not all(isinstance(t, str) for t in types):
        raise Fp8kvError(f"{source}: 'layer_types' must be a list of {num_layers} strings")
    return tuple(types)
