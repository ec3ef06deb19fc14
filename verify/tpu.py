"""On a TPU, whether what verify ran is what vLLM's TPU backend runs: torch_xla's Pallas kernel, from counted calls.

vLLM's torch_xla TPU backend calls the v2 Pallas kernel for every attention layer and fails where that kernel
cannot run. fp8kv's runtime then runs something else (torch_xla's reference, the latent attention, or the model's
own attention over a cache view) and counts it: any of those on a TPU is a FAIL for vLLM's TPU engine, naming the
kernel's rule where the heads are what keeps it out, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fp8kv.checks import FAIL, Finding
from fp8kv.engine_models import VLLM_TPU, engine_of
from fp8kv.geometry import AttentionGeometry
from fp8kv.runtime.attention import XLA_KERNEL
from fp8kv.runtime.kernel_rule import fp8_kernel_note


def tpu_kernel_reasons(device_kind: str, geometry: AttentionGeometry, calls: Mapping[str, int],
                       engines: Sequence[str]) -> list[Finding]:
    """A FAIL for vLLM's TPU engine, when it is among the `engines` judged and, on a TPU, any attention call of
    verify's fp8 runner was not torch_xla's Pallas kernel. `calls` counts attention calls by the function that
    ran (`PagedModelRunner.calls`).
    """
    others = {name: count for name, count in sorted(calls.items()) if name != XLA_KERNEL and count}
    judged = next((name for name in engines if engine_of(name) == VLLM_TPU), None)
    if device_kind != "tpu" or judged is None or not others:
        return []
    heads = [] if geometry.latent is not None else sorted({geometry.layer_kv_heads(layer) for layer in geometry.kv_layers})
    rules = [note for note in (fp8_kernel_note(count) for count in heads) if note]
    why = "; ".join(rules) if rules else ("vLLM's TPU backend runs torch_xla's Pallas kernel for every attention "
                                         "layer and has no other path")
    ran = ", ".join(f"{name} ({count} calls)" for name, count in others.items())
    return [Finding(FAIL, f"engine {judged}: {why}. On this TPU verify ran {ran} instead of the kernel, so its "
                          "numbers are not that engine's", (judged,))]
