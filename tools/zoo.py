"""Tiny checkpoints of every causal-LM architecture the installed transformers knows.

Each one is built from transformers' own config class (its defaults, shrunk: 2 layers, hidden 64,
4 heads of 16, 2 KV heads, a vocabulary matching the factory tokenizer; vision and audio towers as
small where their config sets the sizes), seeded, saved as bf16
safetensors with the factory tokenizer. Tests and the docs/architectures.md table enumerate them from
`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, so a new transformers release brings its new architectures.

    from fp8kv.tools.zoo import causal_lm_types, make_zoo_checkpoint
    path = make_zoo_checkpoint("gpt2", tmp_path / "gpt2")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp8kv.tools.factory import _spread_norm_weights, make_tokenizer

NUM_LAYERS = 2
TOKENIZER_VOCAB = 512

# Sizes set on every config that has the attribute (transformers' attribute maps apply: n_layer, n_head, ...).
_SIZES: dict[str, Any] = {
    "num_hidden_layers": NUM_LAYERS, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_kv_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "ffn_hidden_size": 128, "n_inner": 128, "ffn_dim": 128, "num_local_experts": 4, "num_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "max_position_embeddings": 512,
    "num_kv_shared_layers": 0, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "global_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_headdim": 16,
    "mamba_n_groups": 1, "ssm_state_size": 16, "state_size": 16, "mamba_expand": 2, "n_mamba_heads": 8,
    "mamba_dt_rank": 8, "time_step_rank": 8, "hidden_size_per_layer_input": 16,
    "laurel_rank": 8, "altup_num_inputs": 2, "n_positions": 512, "n_ctx": 512, "rotary_dim": 8,
    "attention_chunk_size": 64, "sliding_window": 64, "tie_word_embeddings": False, "use_cache": True,
    "d_model": 64, "encoder_layers": NUM_LAYERS, "decoder_layers": NUM_LAYERS, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "n_embd": 64,
}
# Architecture-specific settings so the 2 tiny layers keep what makes the architecture what it is,
# and sizes the config class stores derived from its defaults (zamba's attention width) or validates
# against each other (mamba2's heads x head_dim = expand x hidden).
_QWEN_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 32,
             "indexer_compress_ratio": 4}
# sliding layers with more KV heads than global ones, as in the released configs
_INKLING = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 16}
_DOTS3 = {"num_key_value_heads": 4, "per_layer_config": {1: {  # MLA with as many KV heads as heads
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "head_dim": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}}}
_MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}}
_OVERRIDES: dict[str, dict[str, Any]] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # the shared attention block runs on [hidden, embeddings] concatenated: twice the hidden width
    "zamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "attention_hidden_size": 128, "attention_head_dim": 32},
    "zamba2": {"attention_hidden_size": 128, "attention_head_dim": 32, "kv_channels": 16, "num_query_groups": 4,
               "hybrid_layer_ids": [1]},
    "bamba": {"attn_layer_indices": [1]},
    "llama4_text": {"interleave_moe_layer_step": 2, "no_rope_layers": [1, 0]},
    # transformers' defaults give these hybrids no attention layer (or none among the first two)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},  # as real DBRX configs
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen4_exp": _QWEN_QSA, "qwen4_exp_text": _QWEN_QSA,
    "inkling_text": _INKLING, "inkling2_text": _INKLING, "inkling2_loop_text": _INKLING,
    "mimo_v2_flash": {"v_head_dim": 8},  # V heads narrower than K heads, as in the released config
    "mllama": {"cross_attention_layers": [1]},  # one of the two layers attends to the image
    "qwen2_vl": _MROPE, "qwen2_5_vl": _MROPE,  # mrope_section splits head_dim / 2 over (time, height, width)
    "falcon_h1": {"mamba_d_ssm": 128},
    "mamba2": {"num_heads": 8},
    "xlnet": {"d_head": 16},
    "zaya": {"num_experts_per_tok": 1},
    "longcat_flash": {"num_layers": 1},  # each decoder layer holds two attention layers (num_hidden_layers = 2 x this)
    "dots3_note": _DOTS3, "dots3_note_text": _DOTS3,
    "dory": {"layer_types": ["sliding_attention", "full_attention"], "n_input_layers": 1, "n_recurrent_layers": 1,
             "n_output_layers": 0},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0},
    # the causal-LM heads of encoder families, configured as the decoders AutoModelForCausalLM implies
    "xlm": {"causal": True}, "xmod": {"default_language": "en_XX"},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
}
# Constructor arguments for configs whose own defaults fail their validation (an assistant's text config)
# or cannot build a model (Emu3 without its image-token map).
_CONSTRUCTION: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # Emu3 maps its image tokens into the text vocabulary; the tiny one puts them at the end of it
    "emu3": {"vocabulary_map": {"<|extra_200|>": 509, "<image>": 510,
                                **{f"<|visual token {i:06d}|>": 500 + i for i in range(8)}}},
}
# Sizes set on the other towers of a composite config (vision, audio, an image tokenizer's VQ-VAE), named
# by their sub-config: text-only calibration never runs them, but at their default sizes they are most of
# the checkpoint (llava's CLIP tower: 300M parameters). Other sub-configs (dbrx's ffn_config) are the text
# model's own parts.
_TOWER_KINDS = ("vision", "audio", "vq")
_TOWER_SIZES: dict[str, Any] = {
    "num_hidden_layers": NUM_LAYERS, "depth": NUM_LAYERS, "num_blocks": NUM_LAYERS, "hidden_size": 64,
    "embed_dim": 64, "intermediate_size": 128, "mlp_dim": 128, "num_attention_heads": 4, "num_heads": 4,
    "head_dim": 16, "base_channels": 32,
}
# Tower settings a composite config validates against the tiny towers and text model (dots3: its adapters).
_TOWER_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "dots3_note": {"vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}},
}


# Vision-language wrappers transformers does not list as causal LMs, judged with them.
VISION_LANGUAGE = ("llava", "qwen2_vl", "qwen2_5_vl", "mistral3", "idefics3", "paligemma", "llava_next")


def causal_lm_types() -> list[str]:
    """Every model_type the installed transformers maps to a causal LM, then VISION_LANGUAGE, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(VISION_LANGUAGE))


def tiny_config(model_type: str, vocab_size: int, tokenizer: Any):
    """transformers' config for `model_type`, shrunk to a tiny model with `vocab_size` tokens."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_CONSTRUCTION.get(model_type, {}))
    text = config.get_text_config(decoder=True)
    values = _shrunk(text, vocab_size, tokenizer) | _OVERRIDES.get(model_type, {})
    data = config.to_dict()
    if text is config:
        data.update(values)
    for name in config.sub_configs:
        if not isinstance(data.get(name), dict):
            continue
        if getattr(config, name, None) is text:
            data[name] = {**data[name], **values}
        elif any(kind in name for kind in _TOWER_KINDS):
            data[name] = _tiny_tower(data[name])
    data.update({k: v for k, v in values.items() if k in ("vocab_size",) and "vocab_size" in data})
    for name, tower in _TOWER_OVERRIDES.get(model_type, {}).items():
        data[name] = {**data[name], **tower}
    return type(config).from_dict(data)


def _tiny_tower(tower: dict[str, Any]) -> dict[str, Any]:
    """A vision or audio tower's config at the tower sizes; per-layer overrides past its layers are dropped.

    A tower built from a named timm architecture (Gemma 3n's MobileNet) keeps its config: the name fixes its sizes.
    """
    if "architecture" in tower:
        return tower
    shrunk = tower | {k: v for k, v in _TOWER_SIZES.items() if k in tower}
    if isinstance(tower.get("per_layer_config"), dict):
        shrunk["per_layer_config"] = {k: v for k, v in tower["per_layer_config"].items() if int(k) < NUM_LAYERS}
    return shrunk


def _shrunk(text: Any, vocab_size: int, tokenizer: Any) -> dict[str, Any]:
    """The size attributes `text` has, set to the tiny sizes (names as the config class spells them)."""
    values: dict[str, Any] = {}
    stored = text.to_dict()
    for name, value in _SIZES.items():
        if _spelled(text, name) in stored and not isinstance(getattr(type(text), name, None), property):
            values[_spelled(text, name)] = value
    values[_spelled(text, "vocab_size")] = vocab_size
    if "is_decoder" in stored:  # an encoder family's causal-LM head attends causally only as a decoder
        values["is_decoder"] = True
    if "kv_lora_rank" in stored:  # MLA: every head has its K/V; head_dim keeps its meaning (the rope width or not)
        values.update({k: v for k, v in (("num_key_value_heads", _SIZES["num_attention_heads"]),) if k in stored})
        if stored.get("head_dim") == stored.get("qk_rope_head_dim"):  # RoPE is built for head_dim
            values["head_dim"] = _SIZES["qk_rope_head_dim"]
        if "qk_head_dim" in stored:  # stored from the defaults (LongCat-Flash): the query splits into nope + rope
            values["qk_head_dim"] = _SIZES["qk_nope_head_dim"] + _SIZES["qk_rope_head_dim"]
    for name in ("vocab_size_per_layer_input", "unpadded_vocab_size"):  # Gemma 3n's per-layer inputs; Inkling 2's head
        if name in stored:
            values[name] = vocab_size
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values[token] = getattr(tokenizer, token)
    values.update(_per_layer_lists(text))
    return values


def _spelled(config: Any, name: str) -> str:
    """The key config.json uses for `name` (gpt2 writes n_layer for num_hidden_layers)."""
    return getattr(config, "attribute_map", {}).get(name, name)


def _per_layer_lists(text: Any) -> dict[str, list]:
    """Per-layer lists cut to NUM_LAYERS entries: layer 0 and the first layer of another type, if any.

    When layer 0 has no K/V cache (Mamba, MoE-only), the other is the first layer that has one.
    """
    from fp8kv.geometry import cache_layout

    data = text.to_dict()
    count = getattr(text, "num_hidden_layers", None)
    lists = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == count and k != "architectures"}
    types = getattr(text, "layer_types", None) or [0] * (count or 0)
    caches = cache_layout(text, len(types), "config")[1] if getattr(text, "layer_types", None) else [True] * len(types)
    others = [i for i, t in enumerate(types) if t != types[0]]
    other = next((i for i in others if caches[i] or caches[0]), others[0] if others else 1)
    kept = {k: [v[0], v[other]] for k, v in lists.items()}
    overrides = data.get("per_layer_config")
    if isinstance(overrides, dict):  # heterogeneous configs (Gemma 4): overrides keyed by layer index
        by_index = {int(i): v for i, v in overrides.items()}
        kept["per_layer_config"] = {new: by_index[old] for new, old in enumerate((0, other)) if old in by_index}
    return kept


def make_zoo_config(model_type: str, out_dir: str | Path) -> Path:
    """Write only the tiny config.json of `model_type` (enough for fp8kv to accept or refuse it)."""
    tokenizer = make_tokenizer(TOKENIZER_VOCAB)
    tiny_config(model_type, len(tokenizer), tokenizer).save_pretrained(out_dir)
    return Path(out_dir)


def make_zoo_checkpoint(model_type: str, out_dir: str | Path, *, seed: int = 0,
                        overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random bf16 checkpoint of `model_type` with the factory tokenizer; returns `out_dir`.

    `overrides` replace entries of the tiny config (of a text-only config), e.g. more layers.

    The sliding window and attention chunk (64) exceed the zoo's samples, so a `DynamicCache` keeps
    every token: the cache's contents are then an independent reference for the K/V amax.
    """
    from fp8kv.checkpoint.load import model_class

    tokenizer = make_tokenizer(TOKENIZER_VOCAB)
    config = tiny_config(model_type, len(tokenizer), tokenizer)
    if overrides:
        config = type(config).from_dict({**config.to_dict(), **overrides})
    torch.manual_seed(seed)
    model = model_class(config.to_dict()).from_config(config, dtype=torch.bfloat16)
    _spread_norm_weights(model)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
