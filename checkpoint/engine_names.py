"""Which compressed-tensors scale names vLLM loads, per architecture.

vLLM keeps a layer's q/k/v scales on the `Attention` layer it nests inside the checkpoint's attention
module, as `<module>.attn.k_scale`. Most of its model files pass scale names through
`maybe_remap_kv_scale_name`, which maps the short name `<module>.k_scale` onto that path. Before vLLM
0.23 it did so by appending `.attn` to whatever name it was given, so the full path itself became
`.attn.attn.k_scale` and was dropped; from 0.23 a name the model already has is kept as it is. The
model files of the architectures below instead look a scale up by its exact parameter name (a KeyError
for the short name before 0.23), so their checkpoints carry the full path, which every version loads.
"""

from __future__ import annotations

# The attribute under which vLLM's model files nest the `Attention` layer in the attention module.
VLLM_ATTENTION_ATTRIBUTE = "attn"

# Text model types (transformers' `model_type`) whose vLLM model file loads scales by their exact path.
FULL_PATH_MODEL_TYPES = frozenset({
    # gpt2.py, gpt_bigcode.py, gpt_neox.py, bloom.py, mpt.py, falcon.py, opt.py, phi.py, stablelm.py,
    # persimmon.py: `params_dict[name]`, no remapping
    "gpt2", "gpt-sw3", "gpt_bigcode", "gpt_neox", "bloom", "mpt", "falcon", "opt", "phi", "stablelm", "persimmon",
    # gemma.py (also PaliGemma's language model), olmo.py, olmo2.py (Olmo 3 too), olmoe.py (FlexOlmo too),
    # olmo_hybrid.py, qwen2_moe.py: stacked q/k/v mapping, then `params_dict[name]`
    "gemma", "olmo", "olmo2", "olmo3", "olmoe", "flex_olmo", "olmo_hybrid", "qwen2_moe",
    # Hybrids: jamba.py and bamba.py drop the `.self_attn` level, lfm2.py, lfm2_moe.py, granitemoehybrid.py
    # and minimax_text_01.py look the path up as it is
    "jamba", "bamba", "lfm2", "lfm2_moe", "granitemoehybrid", "minimax",
    # gpt_j.py remapped the short name before 0.23; since 0.23 it loads only the full path (the short
    # one, ending in `.attn`, escapes the remapping), so the current behaviour wins
    "gptj",
})


def vllm_scale_module(model_type: str, module: str) -> str:
    """The path under which vLLM loads the scales of the attention module `module` of a `model_type` text model.

    The full `<module>.attn` path where vLLM looks scales up by exact name, else `module` itself
    (vLLM remaps it; architectures vLLM lacks keep the checkpoint's own module path).
    """
    return f"{module}.{VLLM_ATTENTION_ATTRIBUTE}" if model_type in FULL_PATH_MODEL_TYPES else module


# vLLM (0.32) maps ModelOpt's `<module>.k_proj.k_scale` onto its attention layer only under a module named
# `self_attn` (its cache-scale name mapper): under GPT-2's `attn`, GPT-NeoX's `attention` or Falcon's
# `self_attention` the name reaches no parameter and the load fails.
MODELOPT_ATTENTION_MODULE = "self_attn"
# What vLLM (0.32)'s loader of a model type does with Quark's `k_proj.output_scale`, where it does not load it:
# gemma2.py and gemma3.py map `k_proj` onto the fused `qkv_proj` before Quark's scale names are mapped, so the
# name reaches the fused linear ("'QKVParallelLinear' object has no attribute 'data'"); falcon.py loads the
# folder and every attention layer holds 1.0, with no warning.
_FUSED_FIRST = "maps k_proj onto the fused qkv_proj before Quark's scale names, so it refuses k_proj.output_scale"
QUARK_REFUSED = {"gemma2": _FUSED_FIRST, "gemma3": _FUSED_FIRST, "gemma3_text": _FUSED_FIRST,
                 "falcon": "drops k_proj.output_scale without a word and runs every layer at scale 1.0"}


def vllm_format_gap(convention: str, model_type: str, module: str) -> str | None:
    """One line when vLLM (0.32) refuses `convention`'s scale names on the attention module at path `module` of
    a `model_type` model, naming the format it loads; None when it loads them."""
    fix = "for vLLM, fp8kv convert --to compressed-tensors"
    attribute = module.rsplit(".", 1)[-1]
    if convention == "modelopt" and attribute != MODELOPT_ATTENTION_MODULE:
        return (f"vLLM (0.32) loads ModelOpt's k_proj.k_scale only under a {MODELOPT_ATTENTION_MODULE} module and "
                f"{model_type}'s attention module is {attribute}, so it refuses this folder; {fix}")
    if convention == "quark" and model_type in QUARK_REFUSED:
        return f"vLLM (0.32)'s {model_type} loader {QUARK_REFUSED[model_type]}; {fix}"
    return None
