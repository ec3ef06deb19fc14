"""NVFP4 KV-cache scales in checkpoints: what a stored global scale means per tool, how a folder tells which
tool wrote it, and the factor between conventions. No torch.

An NVFP4 cache holds e2m1 values (at most E2M1_MAX) in blocks of NVFP4_BLOCK_SIZE along head_dim, each block
with an e4m3 scale, under one float32 global scale per layer and side: the one the checkpoint stores, as
`amax / divisor`. The tools differ in the divisor only; their tensor names are an fp8 convention's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, get_args

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import E2M1_MAX, FP8_MAX, NVFP4_KV_DTYPES, SCALE_BOUND
from fp8kv.options import Nvfp4Only

if TYPE_CHECKING:
    from fp8kv.checkpoint.kvscales import KVScales

NVFP4_ONLY: tuple[str, ...] = get_args(Nvfp4Only)


@dataclass(frozen=True)
class Nvfp4Convention:
    """One tool's NVFP4 global scale: `stored = amax / divisor`, under the tensor names of fp8 convention
    `tensors`."""

    name: str
    divisor: float
    tensors: str
    producer: str


_SIX_448 = E2M1_MAX * FP8_MAX["fp8_e4m3"]
NVFP4_CONVENTIONS = (
    # modelopt/torch/export/unified_export_hf.py: kv_cache_max_bound = 448 for FP8 and NVFP4 since 0.42.0rc0
    Nvfp4Convention("modelopt", SCALE_BOUND["nvfp4"], "modelopt", "ModelOpt 0.42 and later, and fp8kv"),
    # the same file before: a cache_bound_mapping of 6 * 448 for NVFP4
    Nvfp4Convention("modelopt-pre-0.42", _SIX_448, "modelopt", "ModelOpt before 0.42"),
    # auto-round's NVFP4 static KV export (its llm-compressor export path): amax / 2688
    Nvfp4Convention("auto-round", _SIX_448, "compressed-tensors", "auto-round"),
)
MODELOPT, MODELOPT_PRE_042, AUTO_ROUND = NVFP4_CONVENTIONS
_BY_NAME = {row.name: row for row in NVFP4_CONVENTIONS}
# ModelOpt's hf_quant_config.json kv_cache_quant_algo of each NVFP4 kv dtype
MODELOPT_KV_ALGO = {"nvfp4": "NVFP4", "fp8_k_nvfp4_v": "FP8_K_NVFP4_V"}
_KV_DTYPE_OF_ALGO = {algo: kv for kv, algo in MODELOPT_KV_ALGO.items()}
# compressed-tensors' description of an NVFP4 KV cache, as auto-round's export declares it: 4-bit floats in groups
# of 16 under one tensor scale
AUTO_ROUND_KV_SCHEME = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "dynamic": False, "symmetric": True}
_FIRST_448 = (0, 42)  # the first ModelOpt minor release whose export divides by 448
# fp8kv's own producer block in hf_quant_config.json names the NVFP4 convention it wrote, since ModelOpt's files
# carry no divisor (engines read the producer's name only)
PRODUCER_KEY = "nvfp4_convention"


def nvfp4_convention(name: str) -> Nvfp4Convention:
    """The row of NVFP4 convention `name`."""
    return _BY_NAME[name]


def convention_for_factor(factor: float) -> Nvfp4Convention | None:
    """The convention under ModelOpt's names (which every loader fp8kv read reads) whose stored value a loader
    multiplying by `factor` runs as amax / 448; None where none does."""
    return next((row for row in NVFP4_CONVENTIONS
                 if row.divisor == SCALE_BOUND["nvfp4"] * factor and row.tensors == MODELOPT.tensors), None)


@dataclass(frozen=True)
class Nvfp4Reading:
    """What a checkpoint's NVFP4 scales mean: its kv dtype, the conventions its files allow (one when they tell;
    every candidate when they do not, and each is reported), and how that was decided, in words."""

    kv_dtype: str
    conventions: tuple[str, ...]
    why: str

    @property
    def known(self) -> Nvfp4Convention | None:
        """The one convention of the file, or None when it cannot be told from the files."""
        return nvfp4_convention(self.conventions[0]) if len(self.conventions) == 1 else None


def nvfp4_reading(config: dict[str, Any], hf_quant: dict[str, Any] | None,
                  recorded_format: Callable[[], str | None], where: str) -> Nvfp4Reading | None:
    """The NVFP4 reading of a folder's config files (`where` names the folder in errors), or None when they declare
    no NVFP4 cache. `recorded_format` gives the format fp8kv.json records, which decides for folders fp8kv wrote."""
    algo, algo_file = _modelopt_algo(config, hf_quant)
    four_bit = _four_bit_scheme(config)
    if algo is not None and algo not in _KV_DTYPE_OF_ALGO:
        if "FP4" in algo.upper():
            raise Fp8kvError(f"{where}/{algo_file}: kv_cache_quant_algo {algo!r} is an NVFP4 variant fp8kv does not "
                             f"read; it reads {' and '.join(_KV_DTYPE_OF_ALGO)}")
        algo = None
    if algo is not None and four_bit:
        raise Fp8kvError(f"{where}: {algo_file} declares a ModelOpt {algo} KV cache and config.json a 4-bit "
                         "compressed-tensors kv_cache_scheme (auto-round's); keep one (fp8kv convert writes one)")
    if four_bit:
        return Nvfp4Reading("nvfp4", (AUTO_ROUND.name,), "config.json's 4-bit compressed-tensors kv_cache_scheme")
    if algo is None:
        return None
    kv_dtype = _KV_DTYPE_OF_ALGO[algo]
    if kv_dtype != "nvfp4":  # no ModelOpt before 0.42 exports FP8_K_NVFP4_V
        return Nvfp4Reading(kv_dtype, (MODELOPT.name,), f"{algo_file} kv_cache_quant_algo {algo}")
    return _modelopt_producer(hf_quant if algo_file != "config.json" else config.get("quantization_config"),
                              recorded_format(), algo_file)


def _modelopt_producer(meta: Any, recorded_format: str | None, algo_file: str) -> Nvfp4Reading:
    """ModelOpt's NVFP4 files carry no divisor: the producer's version decides, or fp8kv.json for fp8kv's own."""
    producer = meta.get("producer") if isinstance(meta, dict) else None
    name = producer.get("name") if isinstance(producer, dict) else None
    version = str(producer.get("version", "")) if isinstance(producer, dict) else ""
    both = (MODELOPT.name, MODELOPT_PRE_042.name)
    if recorded_format in both:  # fp8kv wrote the folder, keeping a weight quantizer's producer where there was one
        return Nvfp4Reading("nvfp4", (recorded_format,), f"written by fp8kv as {recorded_format} (fp8kv.json)")
    marked = producer.get(PRODUCER_KEY) if isinstance(producer, dict) else None
    if name == "fp8kv" and marked in both:
        return Nvfp4Reading("nvfp4", (str(marked),), f"{algo_file} producer fp8kv, {PRODUCER_KEY} {marked}")
    if name == "modelopt":
        found = re.match(r"^(\d+)\.(\d+)(?:\.\d+)?(.*)$", version)
        if found:
            minor, suffix = (int(found[1]), int(found[2])), found[3]
            if minor < _FIRST_448:
                return Nvfp4Reading("nvfp4", (MODELOPT_PRE_042.name,), f"{algo_file} producer ModelOpt {version}")
            if minor > _FIRST_448 or "dev" not in suffix:
                return Nvfp4Reading("nvfp4", (MODELOPT.name,), f"{algo_file} producer ModelOpt {version}")
        return Nvfp4Reading("nvfp4", both, f"{algo_file} producer ModelOpt {version or '(no version)'}: a build "
                            "on either side of the change to amax / 448")
    who = f"producer {name!r}" if name else "no producer"
    return Nvfp4Reading("nvfp4", both, f"{algo_file} names {who}; ModelOpt files say no divisor themselves")


def _modelopt_algo(config: dict[str, Any], hf_quant: dict[str, Any] | None) -> tuple[str | None, str]:
    """ModelOpt's kv_cache_quant_algo and the file it is in (hf_quant_config.json, else config.json's block)."""
    for meta, file in ((hf_quant, "hf_quant_config.json"), (config.get("quantization_config"), "config.json")):
        fields = meta.get("quantization", meta) if isinstance(meta, dict) else None
        algo = fields.get("kv_cache_quant_algo") if isinstance(fields, dict) else None
        if isinstance(algo, str):
            return algo, file
    return None, ""


def _four_bit_scheme(config: dict[str, Any]) -> bool:
    for key in ("quantization_config", "compression_config"):
        block = config.get(key)
        scheme = block.get("kv_cache_scheme") if isinstance(block, dict) else None
        if isinstance(scheme, dict) and scheme.get("num_bits") == 4:
            return True
    return False


def mark_producer(hf_quant: dict[str, Any] | None, convention: str | None) -> None:
    """Name the NVFP4 `convention` written (None: an fp8 cache) in fp8kv's own producer block, in place."""
    producer = hf_quant.get("producer") if hf_quant else None
    if not isinstance(producer, dict) or producer.get("name") != "fp8kv":
        return
    producer.pop(PRODUCER_KEY, None)
    if convention is not None:
        producer[PRODUCER_KEY] = convention


def check_nvfp4_target(kv_dtype: str, target: str, strategy: str) -> None:
    """Refuse a convention that cannot carry `kv_dtype`'s scales (NVFP4 or fp8) with `strategy`."""
    nvfp4 = kv_dtype in NVFP4_KV_DTYPES
    if not nvfp4 and target in NVFP4_ONLY:
        raise Fp8kvError(f"{target} is an NVFP4 convention; these scales are {kv_dtype}: use compressed-tensors, "
                         "modelopt, quark or vllm-json")
    if nvfp4 and target not in _BY_NAME:
        raise Fp8kvError(f"{kv_dtype} global scales are written as {', '.join(_BY_NAME)}, not {target!r}")
    if nvfp4 and strategy != "tensor":
        raise Fp8kvError(f"{kv_dtype} takes one global scale per layer and side; drop --per-head")
    if kv_dtype != "nvfp4" and target in NVFP4_ONLY:
        raise Fp8kvError(f"{target} stores nvfp4 K and V; {kv_dtype} (fp8 K, nvfp4 V) is written as modelopt only")


def named_as(tensors: str) -> tuple[str, ...]:
    """The NVFP4-only conventions that use fp8 convention `tensors`' names."""
    return tuple(row.name for row in NVFP4_CONVENTIONS if row.name in NVFP4_ONLY and row.tensors == tensors)


def converted(scales: KVScales, source: str, target: str) -> KVScales:
    """`scales` stored by NVFP4 convention `source`, stored the way `target` stores them: each value times
    source.divisor / target.divisor, rounded once to float32."""
    from fp8kv.checkpoint.kvscales import float32

    factor = nvfp4_convention(source).divisor / nvfp4_convention(target).divisor
    if factor == 1.0:
        return scales

    def times(table: dict[int, tuple[float, ...]]) -> dict[int, tuple[float, ...]]:
        return {layer: tuple(float32(x * factor) for x in values) for layer, values in table.items()}

    return replace(scales, k=times(scales.k), v=times(scales.v))
