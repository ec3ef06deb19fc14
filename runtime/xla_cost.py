"""What one step costs on an XLA device: CPU fallbacks, device-to-host transfers, compiles (torch_xla metrics).

No torch at import: `RuntimeSummary` is what verify's report holds, and the card reads that report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fp8kv.runtime.runner import PagedModelRunner


@dataclass(frozen=True)
class StepCost:
    """Counts over one step: `aten::` ops torch_xla ran on the host, transfers to the host, new graphs."""

    cpu_fallbacks: int
    device_to_host: int
    compiles: int


def compiles() -> int:
    """Graphs torch_xla has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def warm_decode_step(runner: PagedModelRunner, prompt: Sequence[int]) -> StepCost:
    """The cost of a decode step whose shapes were seen: prefill `prompt` and decode one token twice.

    The first pass compiles; the second runs the same shapes on a fresh sequence and is counted.
    """
    import torch_xla.debug.metrics as met

    for measured in (False, True):
        seq, _ = runner.start()
        runner.step([(seq, prompt)])
        if measured:
            met.clear_counters()
            met.clear_metrics()
        runner.step([(seq, prompt[-1:])])
        runner.free(seq)
    fallbacks = sum(met.counter_value(name) or 0 for name in met.counter_names() if name.startswith("aten::"))
    transfers = met.metric_data("TransferFromDeviceTime")
    return StepCost(cpu_fallbacks=int(fallbacks), device_to_host=int(transfers[0]) if transfers else 0,
                    compiles=compiles())


@dataclass(frozen=True)
class Compiles:
    """Graphs torch_xla compiled: while verify ran its checks, and in a warm decode step (0 with bounded shapes)."""

    warmup: int
    timed: int


@dataclass(frozen=True)
class RuntimeSummary:
    """Which attention ran (counted calls) and, on XLA, what a warm fp8 decode step costs and how many graphs
    were compiled.

    `attention_calls` counts calls by the function that ran; `use_kernel` is whether torch_xla's Pallas kernel
    was among them; `attention_numerics` is the arithmetic the logits come from (the runner's `arithmetic`).
    The fallbacks and compiles are None off XLA.
    """

    attention: str
    use_kernel: bool
    attention_calls: dict[str, int]
    attention_numerics: str
    xla_cpu_fallbacks_per_decode_step: int | None
    compiles: Compiles | None


def summarize(runner: PagedModelRunner, prompt: Sequence[int], compiles_before: int | None) -> RuntimeSummary:
    """The runtime section of a report; on XLA it runs one warm decode step of `prompt` on `runner`."""
    if not runner.runtime_device.is_xla:
        return _summary(runner, None, None)
    warmup = compiles() - (compiles_before or 0)
    cost = warm_decode_step(runner, prompt)
    return _summary(runner, cost.cpu_fallbacks, Compiles(warmup=warmup, timed=cost.compiles))


def _summary(runner: PagedModelRunner, fallbacks: int | None, compiled: Compiles | None) -> RuntimeSummary:
    from fp8kv.runtime.attention import XLA_KERNEL

    calls = dict(sorted(runner.calls.items()))
    return RuntimeSummary(runner.attention, calls.get(XLA_KERNEL, 0) > 0, calls, runner.arithmetic, fallbacks, compiled)
