"""Where each tool puts KV scales: tensor names, shapes and config fields.

Conventions: "compressed-tensors" (llm-compressor), "modelopt" (NVIDIA ModelOpt),
"quark" (AMD Quark and AutoFP8, `k_proj.output_scale`), "vllm-json" (vLLM's legacy
`--quantization-param-path` file) and, read only, "kv_scale" (one legacy scale for K and V).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from fp8kv.checkpoint.engine_names import vllm_format_gap, vllm_scale_module
from fp8kv.checkpoint.nvfp4 import (
    AUTO_ROUND, AUTO_ROUND_KV_SCHEME, MODELOPT_KV_ALGO, NVFP4_ONLY, check_nvfp4_target, mark_producer, named_as,
    nvfp4_convention,
)
from fp8kv.kvdtypes import NVFP4_KV_DTYPES, TORCH_DTYPE_NAME
from fp8kv.errors import Fp8kvError
from fp8kv.options import Convention

if TYPE_CHECKING:  # reading names and configs needs no torch
    from fp8kv.checkpoint.kvscales import KVScales

CONVENTIONS = get_args(Convention)
HF_QUANT_CONFIG = "hf_quant_config.json"
SCALES_FILE = "kv_scales.safetensors"
VLLM_JSON_FILE = "kv_cache_scales.json"
QUANTIZATION_CONFIG = "quantization_config"
# Where a KV-only block (compressed-tensors or Quark) goes: vLLM and SGLang read it when quantization_config
# is absent, transformers never reads it, so the checkpoint loads there as a plain model instead of through
# a quantizer that fails on KV-only configs (compressed-tensors) or needs a library installed (Quark).
COMPRESSION_CONFIG = "compression_config"

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Declaration:
    """A field that tells engines to create KV-scale parameters: `path` inside `file` (config.json: its
    quantization block, under quant_method `method` when one is named), set to any value (null, false and
    empty ones aside) or to `value`."""

    file: str
    method: str | None
    path: tuple[str, ...]
    value: str | None = None

    def holds(self, config: dict[str, Any], hf_quant: dict[str, Any] | None) -> bool:
        """Whether the checkpoint's config (`config.json`, `hf_quant_config.json`) sets this field."""
        field: Any = quantization_block(config)[1] if self.file == CONFIG_FILE else hf_quant
        if not isinstance(field, dict) or self.method not in (None, field.get("quant_method")):
            return False
        for key in self.path:
            field = field.get(key) if isinstance(field, dict) else None
        return field == self.value if self.value is not None else field not in (None, False, "", [])


@dataclass(frozen=True)
class ScaleConvention:
    """One way tools store KV scales, as data.

    `tensors`: (name suffix after the attention module, the cache it scales: "k", "v", "q" or "kv" for one
    value of both); `declarations`: (the readout's `declared` key, the field that declares it); `pre_rope`:
    its tools observe k_proj's output, before k_norm and RoPE, not the K the cache stores; `zero_dim`: a
    per-tensor scale is stored as a 0-dim scalar, not `[1]`; `in_json`: the scales are in a top-level JSON
    file (vLLM's legacy `--quantization-param-path` format), not in tensors.
    """

    name: str
    tensors: tuple[tuple[str, str], ...] = ()
    declarations: tuple[tuple[str, Declaration], ...] = ()
    pre_rope: bool = False
    zero_dim: bool = False
    in_json: bool = False

    def suffix(self, kind: str) -> str:
        """The tensor name suffix of cache `kind` ("k", "v" or "q")."""
        return next(suffix for suffix, of in self.tensors if of == kind)


# AutoFP8's declaration of k_proj.output_scale tensors beside fp8 weights; vLLM's Fp8Config then loads them.
AUTOFP8_KV_SCHEME = Declaration(CONFIG_FILE, "fp8", ("kv_cache_scheme",), "static")
# Every convention fp8kv reads, in reading order: exact per-K/V conventions first, one value per layer last.
SCALE_CONVENTIONS = (
    ScaleConvention("compressed-tensors", (("k_scale", "k"), ("v_scale", "v"),
                                           ("q_scale", "q")),  # the query of fp8 attention (llm-compressor)
                    (("compressed-tensors", Declaration(CONFIG_FILE, "compressed-tensors", ("kv_cache_scheme",))),)),
    ScaleConvention("modelopt", (("k_proj.k_scale", "k"), ("v_proj.v_scale", "v")),
                    (("modelopt", Declaration(HF_QUANT_CONFIG, None, ("quantization", "kv_cache_quant_algo"))),),
                    zero_dim=True),
    ScaleConvention("quark", (("k_proj.output_scale", "k"), ("v_proj.output_scale", "v")),
                    (("quark", Declaration(CONFIG_FILE, "quark", ("export", "kv_cache_group"))), ("fp8", AUTOFP8_KV_SCHEME)),
                    pre_rope=True, zero_dim=True),
    ScaleConvention("kv_scale", (("kv_scale", "kv"),), pre_rope=True),  # one legacy scale for K and V, read only
    ScaleConvention("vllm-json", in_json=True),
)
_BY_NAME = {row.name: row for row in SCALE_CONVENTIONS}
# Name suffix after the attention module -> (convention, which cache it scales).
_SUFFIXES = {suffix: (row.name, kind) for row in SCALE_CONVENTIONS for suffix, kind in row.tensors}


def scale_convention(name: str) -> ScaleConvention:
    """The row of convention `name` (an NVFP4-only convention: the row of the names it uses)."""
    return _BY_NAME[nvfp4_convention(name).tensors if name in NVFP4_ONLY else name]


# `<prefix>.<N>.<attention module>.<suffix>`: the first integer in the name is the layer; the module part is
# as short as possible, so "self_attn.k_proj.k_scale" reads as ModelOpt's suffix, not a module named k_proj.
_NAME = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?)(?P<layer>\d+)\.(?P<module>(?:[A-Za-z_]\w*\.)+?)(?P<suffix>"
                   + "|".join(re.escape(s) for s in sorted(_SUFFIXES, key=len, reverse=True)) + r")$")
# The weight of the projection that makes K (alone or fused with Q and V), under its attention module.
_K_PROJECTION = re.compile(
    r"^(?P<module>(?P<prefix>(?:[^.]+\.)*?)(?P<layer>\d+)\.(?:[A-Za-z_]\w*\.)*?[A-Za-z_]\w*)"
    r"\.(?:k_proj|key|c_attn|query_key_value|qkv_proj|Wqkv|qkv|attn\.k_proj)\.weight$"
)
# Towers of multimodal checkpoints and multi-token-prediction heads have their own attention, not the text
# config's layers.
_OTHER_TOWER = re.compile(r"vision|visual|audio|encoder\.|mtp")

_CT_BASE = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
            "config_groups": {}, "ignore": []}
_QUARK_GROUP = ["*k_proj", "*v_proj"]
# A KV-only folder must still name a weight algorithm for vLLM (0.32) to read ModelOpt KV scales: its ModelOpt
# config refuses a null quant_algo, and without one the k_proj.k_scale tensors reach the unquantized qkv loader
# ("'QKVParallelLinear' object has no attribute 'data'"). FP8 with every module excluded loads the weights as
# they are and still gives each attention layer its KV-cache method (vLLM asks for that before exclusions).
MODELOPT_KV_ONLY = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["*"]}
# vLLM's Quark loader builds a quantized scheme for every linear it does not exclude and has none for plain
# weights ("No quark compatible scheme was found"): a KV-only folder excludes every module but vLLM's attention
# layers (named `<attention module>.attn`), which keep their KV-cache method.
QUARK_KV_ONLY_EXCLUDE = r"re:.*(?<!\.attn)$"
ATTENTION_GROUP = "fp8kv_attention"


def is_other_tower(name: str) -> bool:
    """Whether tensor `name` belongs to a vision/audio tower or an MTP head rather than the text layers."""
    return _OTHER_TOWER.search(name) is not None


def parse_scale_name(name: str) -> tuple[int, str, str] | None:
    """(layer, "k"|"v"|"kv", convention) for a KV-scale tensor name, the way vLLM maps it; else None."""
    match = _NAME.match(name)
    if match is None or is_other_tower(name):
        return None
    convention, kind = _SUFFIXES[match["suffix"]]
    return int(match["layer"]), kind, convention


def attention_modules(tensor_names: list[str], layers: tuple[int, ...]) -> dict[int, str]:
    """Each layer's attention module path, read from the checkpoint's own names (its module tree).

    The attention module is the one that owns the K projection: `model.layers.N.self_attn` (Llama),
    `transformer.h.N.attn` (GPT-2, c_attn), `gpt_neox.layers.N.attention` (query_key_value),
    `transformer.blocks.N.norm_attn_norm.attn` (DBRX, Wqkv), `model.language_model.layers.N.self_attn`
    (vision-language wrappers). A layer whose K projection is not found gets the Llama path under
    the checkpoint's layer prefix.
    """
    found: dict[int, str] = {}
    for name in sorted(tensor_names):
        match = _K_PROJECTION.match(name)
        if match and not is_other_tower(name):
            found.setdefault(int(match["layer"]), match["module"])
    prefix = layer_prefix(tensor_names)
    return {layer: found.get(layer, f"{prefix}layers.{layer}.self_attn") for layer in layers}


def vllm_format_gaps(conventions: tuple[str, ...] | list[str], tensor_names: list[str], model_type: str,
                     layer: int) -> str | None:
    """The first of `conventions` whose scale names vLLM (0.32) refuses on this model (its attention module at
    `layer`, read from `tensor_names`), as one line naming the format vLLM loads; None when there is none."""
    module = attention_modules(tensor_names, (layer,))[layer]
    names = [scale_convention(c).name for c in conventions]
    return next((gap for c in names if (gap := vllm_format_gap(c, model_type, module))), None)


def layer_prefix(tensor_names: list[str]) -> str:
    """The prefix in front of `layers.N.` ("model.", "model.language_model.", ...)."""
    for name in sorted(tensor_names):
        match = re.match(r"^(?P<prefix>.*?)layers\.\d+\.", name)
        if match and not is_other_tower(name):
            return match["prefix"]
    return "model."


def scale_names(convention: str, module: str, model_type: str) -> tuple[str, str]:
    """The K and V tensor names `convention` uses for the attention module at path `module` of a `model_type`."""
    row = scale_convention(convention)
    if row.name == "compressed-tensors":
        module = vllm_scale_module(model_type, module)
    return f"{module}.{row.suffix('k')}", f"{module}.{row.suffix('v')}"


def query_scale_name(module: str, model_type: str) -> str:
    """The query-scale tensor name of the attention module at path `module` of a `model_type`, in compressed-tensors."""
    return f"{vllm_scale_module(model_type, module)}.{scale_convention('compressed-tensors').suffix('q')}"


def attention_scheme(config: dict[str, Any]) -> dict[str, Any]:
    """The config group compressed-tensors writes for a static fp8 attention scheme (Q, and K/V through it).

    Targets the model's attention class (`LlamaForCausalLM` -> `LlamaAttention`), as llm-compressor's
    attention recipes do; `input_activations` is the query (and cache) quantization.
    """
    architecture = str((config.get("architectures") or ["Model"])[0])
    target = re.sub(r"For(CausalLM|ConditionalGeneration)$", "", architecture) + "Attention"
    return {"targets": [target], "weights": None, "output_activations": None,
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True}}


def without_attention_schemes(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """`quantization_config` less its activation-only config groups (attention / query schemes).

    transformers applies those through compressed-tensors' hooked attention, which would fake-quantize
    Q inside any model that loads the checkpoint; fp8kv's runtime quantizes Q itself, only when asked.
    """
    qc = copy.deepcopy(quantization_config)
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        qc["config_groups"] = {name: group for name, group in groups.items()
                               if not (isinstance(group, dict) and group.get("weights") is None
                                       and group.get("input_activations") is not None)}
    return qc


def is_vllm_json(path: Path) -> bool:
    """Whether `path` is a legacy vLLM KV-scale file (`{"kv_cache": {"scaling_factor": ...}}`)."""
    if path.stat().st_size > 2**20:
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and isinstance(data.get("kv_cache"), dict) and "scaling_factor" in data["kv_cache"]


def quantization_block(config: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(key, block): the quantization block engines read, `quantization_config` first, else `compression_config`.

    The block is None when neither key holds a dict; the key is then `quantization_config`.
    """
    for key in (QUANTIZATION_CONFIG, COMPRESSION_CONFIG):
        if config.get(key) is not None:
            block = config[key]
            return key, block if isinstance(block, dict) else None
    return QUANTIZATION_CONFIG, None


def weight_method(config: dict[str, Any], hf_quant: dict[str, Any] | None) -> str | None:
    """How the weights are quantized, or None when only the KV cache is (or nothing)."""
    qc = quantization_block(config)[1]
    if hf_quant is not None or (isinstance(qc, dict) and qc.get("quant_method") == "modelopt"):
        fields = _hf_quantization(hf_quant) or _modelopt_fields(qc or {})
        excludes_all = fields.get("exclude_modules") == MODELOPT_KV_ONLY["exclude_modules"]
        return "modelopt" if fields.get("quant_algo") and not excludes_all else None
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method") or "")
    if method == "compressed-tensors":
        return method if without_attention_schemes(qc).get("config_groups") else None
    if method == "quark":
        layers = [qc.get("global_quant_config") or {}, *(qc.get("layer_quant_config") or {}).values()]
        return method if any(isinstance(spec, dict) and spec.get("weight") for spec in layers) else None
    return method or None


@dataclass(frozen=True)
class QuantConfigs:
    """What the writer puts in config.json (`block` under `key`; None: no block) and hf_quant_config.json."""

    key: str
    block: dict[str, Any] | None
    hf_quant: dict[str, Any] | None


def quant_configs(
    convention: str, config: dict[str, Any], hf_quant: dict[str, Any] | None, scales: KVScales, version: str
) -> QuantConfigs:
    """The config blocks to write: the source's weight block gains the KV scheme under its own key; a block
    describing the KV cache alone replaces any old one, under `compression_config`."""
    method = check_method(convention, config, hf_quant)
    check_representable(convention, scales.strategy, scales.kv_dtype)
    if scales.q is not None and convention != "compressed-tensors":
        raise Fp8kvError(f"query scales (q_scale) are written only as compressed-tensors, not {convention!r}; "
                         "write --format compressed-tensors or calibrate without --attention fp8")
    key, block = quantization_block(config)
    qc = copy.deepcopy(block) if method else None
    if convention == "vllm-json":
        return QuantConfigs(key, qc, copy.deepcopy(hf_quant) if method else None)
    if convention == "compressed-tensors":
        key, qc = (key, qc) if qc else (COMPRESSION_CONFIG, copy.deepcopy(_CT_BASE))
        qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": scales.strategy,
                                 "dynamic": False, "symmetric": True}
        if scales.q is not None:
            qc.setdefault("config_groups", {})[ATTENTION_GROUP] = attention_scheme(config)
        return QuantConfigs(key, qc, None)
    if convention == AUTO_ROUND.name:
        key, qc = (key, qc) if qc else (COMPRESSION_CONFIG, copy.deepcopy(_CT_BASE))
        qc["kv_cache_scheme"] = dict(AUTO_ROUND_KV_SCHEME)
        return QuantConfigs(key, qc, None)
    if scale_convention(convention).name == "modelopt":
        algo = MODELOPT_KV_ALGO.get(scales.kv_dtype, "FP8")
        qc, hf_quant = _modelopt_configs(qc, hf_quant if method else None, version, algo)
        mark_producer(hf_quant, convention if scales.kv_dtype in NVFP4_KV_DTYPES else None)
        return QuantConfigs(key, qc, hf_quant)
    if method == "fp8":
        qc[AUTOFP8_KV_SCHEME.path[0]] = AUTOFP8_KV_SCHEME.value
        return QuantConfigs(key, qc, None)
    return QuantConfigs(COMPRESSION_CONFIG if qc is None else key, _quark_config(qc, scales), None)


def check_method(convention: str, config: dict[str, Any], hf_quant: dict[str, Any] | None) -> str | None:
    """The weights' quantization method (None: unquantized), refused when `convention` cannot join it."""
    method = weight_method(config, hf_quant)
    allowed = {
        None: CONVENTIONS + NVFP4_ONLY,
        "compressed-tensors": ("compressed-tensors", "vllm-json", *named_as("compressed-tensors")),
        "fp8": ("quark", "vllm-json"),
        "modelopt": ("modelopt", "vllm-json", *named_as("modelopt")),
        "quark": ("quark", "vllm-json"),
    }
    if method not in allowed:
        raise Fp8kvError(
            f"config.json: the weights are quantized with quant_method {method!r}, which fp8kv cannot add "
            "KV-cache scales to; supported: unquantized, compressed-tensors, fp8, modelopt, quark"
        )
    if convention not in allowed[method]:
        raise Fp8kvError(
            f"config.json: the weights are quantized with {method!r}, whose engines read KV scales only as "
            f"{' or '.join(allowed[method])}; write with that format instead of {convention!r}"
        )
    return method


def check_representable(convention: str, strategy: str, kv_dtype: str) -> None:
    """Refuse a scale strategy ("tensor" or "attn_head") or kv dtype that `convention` cannot carry."""
    if kv_dtype in NVFP4_KV_DTYPES or convention in NVFP4_ONLY:
        check_nvfp4_target(kv_dtype, convention, strategy)
        return
    if strategy == "attn_head" and convention != "compressed-tensors":
        raise Fp8kvError(f"per-head (attn_head) scales can only be written as compressed-tensors, not {convention}; "
                         "drop --per-head or use --format compressed-tensors")
    if kv_dtype != "fp8_e4m3" and convention in ("compressed-tensors", "modelopt"):
        raise Fp8kvError(f"{convention} stores fp8_e4m3 KV caches only; {kv_dtype} needs --format quark or vllm-json")


def _hf_quantization(hf_quant: dict[str, Any] | None) -> dict[str, Any]:
    """hf_quant_config.json's `quantization` object ({} when absent or not an object)."""
    fields = (hf_quant or {}).get("quantization")
    return fields if isinstance(fields, dict) else {}


def _modelopt_fields(qc: dict[str, Any]) -> dict[str, Any]:
    return qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc


def _modelopt_configs(qc: dict[str, Any] | None, hf_quant: dict[str, Any] | None, version: str, algo: str):
    # vLLM takes a folder for ModelOpt by its producer name or by quant_method; fp8kv is not ModelOpt
    hf_quant = copy.deepcopy(hf_quant) or {"producer": {"name": "fp8kv", "version": version},
                                           "quant_method": "modelopt", "quantization": dict(MODELOPT_KV_ONLY)}
    hf_quant.setdefault("quantization", {})["kv_cache_quant_algo"] = algo
    if qc is not None:
        _modelopt_fields(qc)["kv_cache_quant_algo"] = algo
    return qc, hf_quant


def quark_tensor_spec(kv_dtype: str) -> dict[str, Any]:
    """Quark's description of a static per-tensor fp8 output quantizer."""
    return {"dtype": kv_dtype, "qscheme": "per_tensor", "ch_axis": None, "group_size": None, "symmetric": True,
            "round_method": "half_even", "scale_type": "float", "is_dynamic": False,
            "observer_cls": "PerTensorMinMaxObserver"}


def _quark_config(qc: dict[str, Any] | None, scales: KVScales) -> dict[str, Any]:
    empty = {"weight": None, "input_tensors": None, "output_tensors": None, "bias": None, "target_device": None}
    qc = qc or {"quant_method": "quark", "quant_mode": "eager_mode", "global_quant_config": dict(empty),
                "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": [QUARK_KV_ONLY_EXCLUDE],
                "algo_config": None,
                "export": {"weight_format": "real_quantized", "pack_method": "reorder", "min_kv_scale": 0.0}}
    base = qc.get("global_quant_config") or empty
    layers = qc.setdefault("layer_quant_config", {})
    for group in _QUARK_GROUP:
        layers[group] = {**base, **layers.get(group, {}), "output_tensors": quark_tensor_spec(scales.kv_dtype)}
    qc.setdefault("export", {})["kv_cache_group"] = list(_QUARK_GROUP)
    return qc


def vllm_loading_gap(convention: str, config: dict[str, Any], hf_quant: dict[str, Any] | None) -> str | None:
    """Why vLLM (0.32) refuses a KV-only ModelOpt or Quark folder written without the fields above, or None.

    ModelOpt's and Quark's own KV-only exports name no weight algorithm (ModelOpt) or exclude no module (Quark).
    """
    if weight_method(config, hf_quant) is not None:
        return None
    if convention == "modelopt" and hf_quant is not None and not _hf_quantization(hf_quant).get("quant_algo"):
        return ("hf_quant_config.json names no quant_algo: vLLM (0.32) loads ModelOpt KV scales only beside one "
                "(\"'QKVParallelLinear' object has no attribute 'data'\")")
    block = quantization_block(config)[1] or {}
    if convention == "quark" and block.get("quant_method") == "quark" and not block.get("exclude"):
        return ("the Quark config quantizes no weights and excludes no module: vLLM (0.32) then finds no scheme for "
                "the linear layers (\"No quark compatible scheme was found\")")
    return None


def vllm_json_readers(path: str | Path) -> str:
    """Which engines read the legacy vLLM JSON scale file at `path`, in one line.

    vLLM dropped --quantization-param-path: 0.32 has no such option and runs such a folder at scale 1.0. SGLang
    0.5.23 still takes the file, but its loader holds one value per layer that its attention does not run as
    written (or the engine does not start on the folder), for every model class its own loader was run on.
    """
    return (f"no engine release fp8kv checked runs it: SGLang 0.5.23 takes it (--kv-cache-dtype fp8_e4m3 "
            f"--quantization-param-path {path}) but its attention does not run the value its loader holds, and vLLM "
            "no longer reads it (0.32 runs the folder at scale 1.0): fp8kv convert --to compressed-tensors")


def vllm_json(scales: KVScales, model_type: str) -> dict[str, Any]:
    """The legacy vLLM file: one value per layer for K and V, so the larger (never-saturating) one.

    The exact K and V scales ride along under "fp8kv" (engines ignore it), so reading back is lossless.
    """
    per_layer = {str(i): max(max(k), max(v)) for i in scales.layers for k, v in [scales.values(i)]}
    return {
        "model_type": model_type,
        "kv_cache": {"dtype": TORCH_DTYPE_NAME[scales.kv_dtype], "scaling_factor": {"0": per_layer}},
        "fp8kv": {"k_scale": {str(i): scales.values(i)[0][0] for i in scales.layers},
                  "v_scale": {str(i): scales.values(i)[1][0] for i in scales.layers}},
    }
