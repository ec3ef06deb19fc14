"""The scales of a running vLLM engine (`vllm.LLM`): per-tensor K/V scales sent to every attention layer, and what
every layer holds read back and compared with what was sent, the live counterpart of `fp8kv load-check`.

Both go through `engine.collective_rpc`, which runs a function with each worker as its first argument, inside the
engine: the worker-side functions below import torch and vLLM there. With vLLM's engine core in a process of its
own the function crosses the process boundary only with `VLLM_ALLOW_INSECURE_SERIALIZATION=1` set before the
engine starts, and fp8kv must be importable there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.console import markdown_table
from fp8kv.errors import Fp8kvError
from fp8kv.inspection import Scale, scale_rows
from fp8kv.loadcheck.run import LayerLoad

# Each copy vLLM keeps of an attention layer's K and V scale: its loader sets all three
# (`BaseKVCacheMethod.process_weights_after_loading`) and each backend reads one (CUDA kernels the tensor, host code
# the host tensor, vLLM's CPU attention the float, on every call), so a copy left behind is a scale some path runs.
ENGINE_SCALE_COPIES = {"float": ("_k_scale_float", "_v_scale_float"), "tensor": ("_k_scale", "_v_scale"),
                       "host": ("_k_scale_cpu", "_v_scale_cpu")}
_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class HeldLayer:
    """One attention layer of one worker: its K and V scale in each copy (`ENGINE_SCALE_COPIES`' order; a tuple
    where the copy holds one value per head)."""

    layer: int
    k: tuple[Scale, ...]
    v: tuple[Scale, ...]


@dataclass(frozen=True)
class WorkerScales:
    """What one worker answered: the engine's and torch's versions, and every attention layer it holds."""

    engine: str
    engine_version: str
    torch_version: str
    layers: tuple[HeldLayer, ...]


@dataclass(frozen=True)
class HeldCopy:
    """One copy of the scales on one worker against what was sent: a `LayerLoad` per layer, its `file_k`/`file_v`
    the sent scales (None: none sent for the layer) and `held_k`/`held_v` the copy's (None: no worker holds it)."""

    worker: int
    copy: str
    layers: tuple[LayerLoad, ...]

    @property
    def ok(self) -> bool:
        """Whether every layer holds the sent K and V bit for bit."""
        return bool(self.layers) and all(layer.matches for layer in self.layers)


@dataclass(frozen=True)
class EngineScaleCheck:
    """What `check_engine_scales` read from a running engine: its versions and every worker's copies of the
    scales, layer by layer, against what was sent."""

    engine: str
    engine_version: str
    torch_version: str
    copies: tuple[HeldCopy, ...]

    @property
    def ok(self) -> bool:
        """Whether every copy on every worker holds the sent scales."""
        return bool(self.copies) and all(copy.ok for copy in self.copies)


def send_scales(engine: Any, scales: KVScales) -> None:
    """Hand per-tensor K/V scales to every attention layer of a running engine, every copy vLLM keeps, tensors in
    place; then reset its prefix cache, whose blocks were quantized with the old scales."""
    if scales.strategy != "tensor":
        raise Fp8kvError("send_scales: per-head scales; vLLM's CPU and Triton attention read one K and one V scale "
                         "per layer, so send per-tensor scales (scales_from(..., per_head=False))")
    per_layer = {row.layer: (row.k_scale, row.v_scale) for row in scale_rows(scales)}
    engine.collective_rpc(_set_scales_on_worker, args=(per_layer,))
    engine.reset_prefix_cache()


def check_engine_scales(engine: Any, sent: KVScales) -> EngineScaleCheck:
    """What every attention layer of a running engine holds, on every worker and in every copy, against `sent`."""
    answers: list[WorkerScales] = engine.collective_rpc(_held_scales_on_worker)
    if not answers:
        raise Fp8kvError("check_engine_scales: the engine answered from no worker")
    in_sent = {row.layer: (row.k_scale, row.v_scale) for row in scale_rows(sent)}
    held_anywhere = {held.layer for answer in answers for held in answer.layers}
    copies = []
    for worker, answer in enumerate(answers):
        for index, copy in enumerate(ENGINE_SCALE_COPIES):
            held = {layer.layer: (layer.k[index], layer.v[index]) for layer in answer.layers}
            numbers = held.keys() | (in_sent.keys() - held_anywhere)  # a layer on another worker is not missing here
            layers = tuple(LayerLoad(i, *in_sent.get(i, (None, None)), *held.get(i, (None, None)))
                           for i in sorted(numbers))
            copies.append(HeldCopy(worker, copy, layers))
    first = answers[0]
    return EngineScaleCheck(first.engine, first.engine_version, first.torch_version, tuple(copies))


def render_engine_check(check: EngineScaleCheck) -> str:
    """The check as text: per layer the sent K/V and, per worker and copy, "yes" or what it holds instead; a line
    on each copy that does not hold the sent scales; a last line on all of them."""
    head = ["layer", "k_scale sent", "v_scale sent", *(f"worker {c.worker} {c.copy}" for c in check.copies)]
    by_copy = [{layer.layer: layer for layer in c.layers} for c in check.copies]
    sent = {layer.layer: layer for c in check.copies for layer in c.layers}
    rows = [[str(i), repr(sent[i].file_k), repr(sent[i].file_v), *(_held_cell(held.get(i)) for held in by_copy)]
            for i in sorted(sent)]
    lines = [f"{check.engine} {check.engine_version} (torch {check.torch_version}): the K/V scales its layers hold",
             markdown_table(head, rows)]
    lines += [f"worker {c.worker} {c.copy}: {_held_instead(c)}" for c in check.copies if not c.ok]
    return "\n".join([*lines, "every layer holds the sent scales in every copy" if check.ok
                      else "NOT every layer holds the sent scales"])


def _held_cell(layer: LayerLoad | None) -> str:
    if layer is None:
        return "-"  # on another worker
    return "yes" if layer.matches else f"k {layer.held_k!r}, v {layer.held_v!r}"


def _held_instead(copy: HeldCopy) -> str:
    """What a copy holds where it does not hold the sent scales."""
    wrong = [layer for layer in copy.layers if not layer.matches]
    text = f"{len(wrong)} of {len(copy.layers)} layers hold other scales"
    if all(layer.holds_one for layer in wrong):
        return text + ", 1.0 each: the scales never arrived"
    if all(layer.held_k == 0.0 and layer.held_v == 0.0 for layer in wrong):
        return text + ", 0.0 each: the scale tensors were emptied and not refilled"
    return text


def _attention_layers(model: Any) -> dict[int, Any]:
    """vLLM's attention layers by layer number, read from `layer_name` ("model.layers.3.self_attn.attn")."""
    layers = {}
    for module in model.modules():
        if hasattr(module, "_k_scale_float") and hasattr(module, "layer_name"):
            found = _LAYER_NUMBER.search(f".{module.layer_name}.")
            if found is None:
                raise Fp8kvError(f"attention layer {module.layer_name!r} has no layer number in its name")
            layers[int(found.group(1))] = module
    return layers


def _set_scales_on_worker(worker: Any, scales: dict[int, tuple[float, float]]) -> None:
    """Run on each worker: every copy of each attention layer's K and V scale set to `scales`, all layers checked
    before any is changed."""
    layers = _attention_layers(worker.get_model())
    missing = sorted(layers.keys() - scales.keys())
    if missing:
        raise Fp8kvError(f"send_scales: the scales do not cover the engine's attention layers {missing}")
    for index, layer in layers.items():
        for copy, names in ENGINE_SCALE_COPIES.items():
            for name, value in zip(names, scales[index]):
                if copy == "float":
                    setattr(layer, name, value)
                else:
                    getattr(layer, name).fill_(value)  # in place: a captured CUDA graph reads this storage


def _held_scales_on_worker(worker: Any) -> WorkerScales:
    """Run on each worker: the engine's versions and each attention layer's K and V scale in every copy."""
    import torch
    import vllm  # the worker's own: this runs inside the engine

    def value(held: Any) -> Scale:
        if isinstance(held, torch.Tensor) and held.numel() > 1:
            return tuple(float(x) for x in held.flatten().tolist())
        return float(held)

    layers = tuple(HeldLayer(index, *(tuple(value(getattr(layer, names[part])) for names in ENGINE_SCALE_COPIES.values())
                                      for part in (0, 1)))
                   for index, layer in sorted(_attention_layers(worker.get_model()).items()))
    return WorkerScales("vllm", vllm.__version__, torch.__version__, layers)
