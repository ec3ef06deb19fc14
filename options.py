"""The closed sets of choices the command line offers, importable without torch.

The CLI parses them (so a typo fails at once and `--help` lists them) and the library derives its
tuples from them with `typing.get_args`, so each list of names has this one home.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Literal, get_args

from fp8kv.errors import Fp8kvError

Convention = Literal["compressed-tensors", "modelopt", "quark", "vllm-json"]
WriteMode = Literal["overlay", "copy"]
# the engines whose own loader `fp8kv load-check` runs (loadcheck/probes/<engine>.py)
LoadEngine = Literal["vllm", "sglang"]
# overlay hard-links the source's weights (no second copy on disk); copy makes a self-contained folder.
DEFAULT_MODE: WriteMode = "overlay"
KvDtype = Literal["fp8_e4m3", "fp8_e5m2"]
DEFAULT_KV_DTYPE: KvDtype = "fp8_e4m3"
# NVFP4 caches: e2m1 values in blocks with an e4m3 scale each, under one float32 global scale per layer and side
# (the checkpoint's); fp8_k_nvfp4_v keeps K in fp8 e4m3 (ModelOpt's kv_cache_quant_algo FP8_K_NVFP4_V).
Nvfp4KvDtype = Literal["nvfp4", "fp8_k_nvfp4_v"]
FP8_K_NVFP4_V: Nvfp4KvDtype = "fp8_k_nvfp4_v"
# An engine's NVFP4 cache writes, as vLLM's `--kv-cache-dtype` names them: a serving choice, not a checkpoint format.
# Both read the same global scale, so a kv dtype "nvfp4" folder is served by either; the 4over6 write picks each
# block's scale from two targets (nvfp4.py).
Nvfp4Write = Literal["nvfp4", "nvfp4_4over6"]
DEFAULT_NVFP4_WRITE: Nvfp4Write = "nvfp4"
FOUR_OVER_SIX_WRITE: Nvfp4Write = "nvfp4_4over6"
KvDtypeSpelling = Literal["fp8_e4m3", "fp8_e5m2", "fp8", "nvfp4", "fp8_k_nvfp4_v"]
# What `fp8kv convert --to` writes: every convention, and the two NVFP4 conventions whose stored global scale is
# amax / (6 * 448) rather than ModelOpt's current amax / 448 (checkpoint/nvfp4.py)
Nvfp4Only = Literal["modelopt-pre-0.42", "auto-round"]
ConvertTarget = Literal["compressed-tensors", "modelopt", "quark", "vllm-json", "modelopt-pre-0.42", "auto-round"]
# The NVFP4 conventions a source's scales can be in (`convert --from`, where its files do not tell)
Nvfp4Source = Literal["modelopt", "modelopt-pre-0.42", "auto-round"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
RuntimeChoice = Literal["auto", "tpu", "xla-cpu", "cuda", "cpu"]
# Calibration runs transformers' own forward: CUDA or CPU.
TorchDeviceChoice = Literal["auto", "cuda", "cpu"]
# kv: K/V cache scales only; fp8: also query scales for fp8 attention kernels.
AttentionChoice = Literal["kv", "fp8"]
# The caches `fp8kv eval` and the lm_eval model `fp8kv` run on (--model_args kv_cache=..., scales=...): bf16, or
# fp8 with the checkpoint's scales or unit scales.
EvalCache = Literal["bf16", "fp8"]
ScaleSource = Literal["checkpoint", "unit"]
# What verify concludes; the exit code of each is in errors.ExitCode.
Verdict = Literal["PASS", "WARN", "FAIL"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
LAST_BATCH = "last-batch"
# The default margin above amax / MAX, so unseen text of the calibration distribution stays inside
# fp8's range (chosen from bench/bench_headroom.py). It costs no accuracy: e4m3 has the same
# relative precision across its normal range.
DEFAULT_HEADROOM = 1.25

# How to install an extra, as every message says it (pip's name for the package; from a clone, the folder).
EVAL_EXTRA_HINT = 'pip install "fp8kv[eval]" (from a clone: pip install ".[eval]")'
TPU_EXTRA_HINT = 'pip install "fp8kv[tpu]" (from a clone: pip install ".[tpu]")'

# vLLM's `--kv-cache-dtype fp8` means e4m3; accept its spelling.
KV_DTYPE_SPELLINGS: dict[str, KvDtype] = {"fp8": "fp8_e4m3"}


def kv_dtype_name(spelling: str) -> str:
    """fp8kv's name for a kv dtype as typed (`fp8` -> `fp8_e4m3`)."""
    return KV_DTYPE_SPELLINGS.get(spelling, spelling)


def check_headroom(headroom: float) -> float:
    """A scale below amax/MAX clips values calibration saw: the headroom is a finite number, at least 1."""
    if not math.isfinite(headroom):
        raise Fp8kvError(f"--headroom {headroom:g} is not a finite number: the scales would be {headroom:g} too")
    if headroom < 1.0:
        raise Fp8kvError(f"--headroom {headroom:g} is below 1.0: a scale under amax/MAX clips values it has seen")
    return headroom


@dataclass(frozen=True)
class Strategy:
    """How the clip value (the |x| that maps to MAX) is chosen: amax, percentile:P, mse or last-batch."""

    name: str
    percentile: float | None = None

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse `amax`, `mse`, `last-batch` or `percentile:P` with 0 < P <= 100."""
        name, _, arg = text.strip().partition(":")
        if name in ("amax", "mse", LAST_BATCH) and not arg:
            return cls(name)
        if name == "percentile":
            try:
                value = float(arg)
            except ValueError:
                value = float("nan")
            if 0.0 < value <= 100.0:
                return cls(name, value)
        raise Fp8kvError(
            f"--strategy {text!r}: use amax, mse, last-batch, or percentile:P with 0 < P <= 100 (e.g. percentile:99.99)"
        )

    def __str__(self) -> str:
        return f"percentile:{self.percentile:g}" if self.name == "percentile" else self.name
