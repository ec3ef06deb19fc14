"""Load a checkpoint's causal LM with transformers, refusing weights it had to invent or ignore.

transformers fills a weight the files lack with random values (a checkpoint whose config says
`tie_word_embeddings: false` but ships no `lm_head.weight` gets a random head) and drops tensors
it has no place for, with only a log line. Either makes every number measured on the model wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from fp8kv.checkpoint.conventions import QUANTIZATION_CONFIG, parse_scale_name, without_attention_schemes
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.transformers_cache import recurrent_layers

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


def weights_config(model_dir: str | Path, trust_remote_code: bool = False):
    """transformers' config of `model_dir` for loading its weights, less what is not about the weights.

    transformers 5.24 acts on a compressed-tensors block under `quantization_config` (llm-compressor's
    KV-only outputs; fp8kv's beside quantized weights): a KV-cache-only one runs the compressed-tensors
    quantizer, which fails on MoE checkpoints stored per expert (its expert merge looks up a weight group
    that does not exist) and on configs whose head counts live in a sub-config (vision-language wrappers);
    an attention scheme hooks attention and fake-quantizes Q in every model, a bf16 reference included.
    The scales are not weights, so fp8kv loads without either and reads the scales itself.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    qc = getattr(config, QUANTIZATION_CONFIG, None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        qc = without_attention_schemes(qc)
        if qc.get("config_groups"):
            config.quantization_config = qc
        else:
            del config.quantization_config
    return config


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
                        attn_implementation: str | None = None, *, paged_attention: str | None = None) -> Any:
    """The checkpoint's language model (`model_class`) on `device` in eval mode, refusing mismatched weights.

    `dtype` is a `--dtype` name or "auto" (the checkpoint's). `attn_implementation`: a registered attention
    function the model must run (an error for a model that computes attention in its own code); None keeps
    transformers' default. `paged_attention`: a registered attention function the model runs where it can;
    a model with its own attention code, or a hybrid with recurrent layers, keeps its own (a runner then
    reads its pages through a cache view).
    """
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise Fp8kvError(f"--dtype {dtype!r}: choose auto, {', '.join(MODEL_DTYPES)}")
    config = weights_config(model_dir, trust_remote_code)
    if attn_implementation is not None and not takes_attention_function(config):
        raise Fp8kvError(f"{model_dir}: {config.model_type} computes attention in its own code, not through "
                         f"transformers' attention interface, so it cannot run {attn_implementation!r}")
    if paged_attention is not None and takes_attention_function(config) and not _hybrid(model_dir):
        attn_implementation = paged_attention
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = load_causal_lm(model_dir, model_class(config.to_dict()), config, dtype=MODEL_DTYPES.get(dtype, "auto"),
                           trust_remote_code=trust_remote_code, **extra)
    model = model.to(device).eval()
    if torch.device(device).type == "xla" and model._can_set_experts_implementation():
        # transformers' default MoE path (grouped_mm) counts tokens per expert with an integer histc that
        # XLA cannot run; batched_mm computes each token's chosen experts with static shapes
        model.set_experts_implementation("batched_mm")
    return model


def _hybrid(model_dir: str | Path) -> bool:
    return bool(recurrent_layers(AttentionGeometry.from_dir(model_dir).layer_types))


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
