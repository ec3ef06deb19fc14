"""The closed sets of choices the command line offers, importable without torch.

The CLI parses them (so a typo fails at once and `--help` lists them) and the library derives its
tuples from them with `typing.get_args`, so each list of names has this one home.
"""

from typing import Literal

Convention = Literal["compressed-tensors", "modelopt", "quark", "vllm-json"]
WriteMode = Literal["overlay", "copy"]
KvDtype = Literal["fp8_e4m3", "fp8_e5m2"]
DEFAULT_KV_DTYPE: KvDtype = "fp8_e4m3"
KvDtypeSpelling = Literal["fp8_e4m3", "fp8_e5m2", "fp8"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
RuntimeChoice = Literal["auto", "tpu", "xla-cpu", "cuda", "cpu"]
# Calibration runs transformers' own forward: CUDA or CPU.
TorchDeviceChoice = Literal["auto", "cuda", "cpu"]
# kv: K/V cache scales only; fp8: also query scales for fp8 attention kernels.
AttentionChoice = Literal["kv", "fp8"]
# How an engine casts `x / scale` to fp8; fp8kv.fp8 says what each one does.
EngineName = Literal["clamp", "raw", "raw-bf16"]
EngineChoice = Literal["all", "clamp", "raw", "raw-bf16"]

# vLLM's `--kv-cache-dtype fp8` means e4m3; accept its spelling.
KV_DTYPE_SPELLINGS: dict[str, KvDtype] = {"fp8": "fp8_e4m3"}


def headroom_problem(factor: float) -> str | None:
    """Why `--headroom factor` is refused, or None: a scale under amax/MAX clips values calibration saw."""
    return None if factor >= 1.0 else f"{factor} is below 1.0: a scale under amax/MAX clips values it has seen"


def kv_dtype_name(spelling: str) -> str:
    """fp8kv's name for a kv dtype as typed (`fp8` -> `fp8_e4m3`)."""
    return KV_DTYPE_SPELLINGS.get(spelling, spelling)
