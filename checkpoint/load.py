"""Load a checkpoint's causal LM with transformers, refusing weights it had to invent or ignore.

transformers fills a weight the files lack with random values (a checkpoint whose config says
`tie_word_embeddings: false` but ships no `lm_head.weight` gets a random head) and drops tensors
it has no place for, with only a log line. Either makes every number measured on the model wrong.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from fp8kv.checkpoint.conventions import parse_scale_name, weights_config
from fp8kv.errors import Fp8kvError

# `--dtype` names of the weights dtype ("auto": the checkpoint's own).
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_SHOWN = 5


class WeightsMismatch(Fp8kvError):
    """The weight files do not match the model config.json describes (missing, unexpected or misshapen)."""


def load_causal_lm(model_dir: str | Path, model_class: Any = None, config: Any = None, **kwargs: Any) -> Any:
    """`model_class.from_pretrained(model_dir, **kwargs)` (default `AutoModelForCausalLM`) on the weights'
    config (`weights_config`, read here unless given); `WeightsMismatch` naming the tensors transformers
    reports missing, unexpected or of the wrong shape (K/V/Q scales are read by fp8kv itself).
    """
    from transformers import AutoModelForCausalLM

    config = config or weights_config(model_dir, kwargs.get("trust_remote_code", False))
    model_class = model_class or AutoModelForCausalLM
    model, info = model_class.from_pretrained(model_dir, config=config, output_loading_info=True, **kwargs)
    problems = [
        _named("missing (randomly initialized)", info.get("missing_keys") or ()),
        _named("unexpected (ignored)", [k for k in info.get("unexpected_keys") or () if parse_scale_name(k) is None]),
        _named("of the wrong shape", [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()]),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise WeightsMismatch(f"{model_dir}: the weight files do not match config.json: {'; '.join(problems)}")
    return model


def _named(what: str, keys: Any) -> str:
    names = sorted(str(k) for k in keys)
    if not names:
        return ""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{len(names)} weight(s) {what}: {', '.join(names[:_SHOWN])}{more}"


def model_class(config: dict[str, Any]):
    """The transformers auto class that builds this checkpoint's language model with its weight names.

    `AutoModelForCausalLM` for every model_type it lists; vision-language wrappers it does not list
    (llava, qwen2-vl, ...) load as `AutoModelForImageTextToText`, whose base model runs the language
    model on text alone.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    model_type = config.get("model_type")
    wrapped = model_type in VLM and (model_type not in CAUSAL or model_type in _CAUSAL_CLASS_READS_TEXT_ONLY)
    return AutoModelForImageTextToText if wrapped else AutoModelForCausalLM


# Vision-language model types whose causal-LM class loads only a text-only checkpoint: from the full
# checkpoint (Emu3ForConditionalGeneration's `model.text_model.`) it would start from random weights.
_CAUSAL_CLASS_READS_TEXT_ONLY = frozenset({"emu3"})


def load_language_model(model_dir: str | Path, device: Any, dtype: str = "auto", trust_remote_code: bool = False,
                        attn_implementation: str | None = None) -> Any:
    """The checkpoint's language model (`model_class`) on `device` in eval mode, refusing mismatched weights.

    `dtype` is a `--dtype` name or "auto" (the checkpoint's); `attn_implementation` None keeps
    transformers' default attention.
    """
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise Fp8kvError(f"--dtype {dtype!r}: choose auto, {', '.join(MODEL_DTYPES)}")
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = weights_config(model_dir, trust_remote_code)
    if attn_implementation is not None and not takes_attention_function(config):
        raise Fp8kvError(f"{model_dir}: {config.model_type} computes attention in its own code, not through "
                         f"transformers' attention interface, so it cannot run {attn_implementation!r}")
    model = load_causal_lm(model_dir, model_class(config.to_dict()), config, dtype=MODEL_DTYPES.get(dtype, "auto"),
                           trust_remote_code=trust_remote_code, **extra)
    return model.to(device).eval()


def takes_attention_function(config: Any) -> bool:
    """Whether the model of `config` (a transformers config) computes attention through transformers'
    AttentionInterface, so a registered attention function replaces it.

    Some compute attention in their own code (falcon, bloom, mpt: inline eager/SDPA, some with ALiBi) and
    fail on an attention name they do not know. The test is transformers' own; a model class transformers
    does not map (remote code) is assumed to take one.
    """
    model_cls = model_class(config.to_dict())._model_mapping.get(type(config), None)
    return model_cls is None or (model_cls._can_set_attn_implementation() and not _own_attention_table(model_cls))


def _own_attention_table(model_cls: type) -> bool:
    """Whether the model's module picks its attention classes from its own table keyed by attention name
    (git's text attention: eager only); transformers' check sees only that the module calls the interface
    somewhere (git's vision tower does). A vision tower's own table (SAM's, in OCR models) says nothing of the text."""
    module = sys.modules[model_cls.__module__]
    return any(name.endswith("ATTENTION_CLASSES") and "VISION" not in name and isinstance(table, dict)
               and "eager" in table for name, table in vars(module).items())


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
