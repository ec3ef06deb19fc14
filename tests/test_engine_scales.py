"""fp8kv.api's scales for a running vLLM engine (`send_scales`, `check_engine_scales`) without vLLM: a stand-in
engine runs `collective_rpc` on stand-in workers whose attention layers keep every copy of the scales vLLM's
loader sets, under vLLM's attribute names, starting at 1.0 as vLLM's do when a checkpoint has none."""

from __future__ import annotations

import re
import struct
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8kv import api
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SENT = KVScales.from_floats(k={i: 0.0123 + i / 100 for i in range(4)}, v={i: 0.0789 - i / 100 for i in range(4)})
OTHER = KVScales.from_floats(k={i: 0.0456 + i / 100 for i in range(4)}, v={i: 0.0321 + i / 100 for i in range(4)})


class Attention(torch.nn.Module):
    """A vLLM attention layer as its loader leaves it: each scale as a float, a tensor and a host tensor."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer}.self_attn.attn"
        for part in "kv":
            setattr(self, f"_{part}_scale_float", 1.0)
            self.register_buffer(f"_{part}_scale", torch.tensor(1.0))
            setattr(self, f"_{part}_scale_cpu", torch.tensor(1.0))


class Worker:
    def __init__(self, layers: range) -> None:
        self.model = torch.nn.ModuleList([torch.nn.Linear(2, 2), *(Attention(i) for i in layers)])

    def get_model(self) -> torch.nn.Module:
        return self.model


class Engine:
    """`vllm.LLM`'s `collective_rpc` (a callable runs with each worker first) and `reset_prefix_cache`."""

    def __init__(self, *splits: range) -> None:
        self.workers = [Worker(layers) for layers in splits or (range(4),)]
        self.prefix_resets = 0
        self.methods_called: list[str] = []

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if isinstance(method, str):  # a worker method by name: a weight reload keeps the layers' scales
            self.methods_called.append(method)
            return [None for _ in self.workers]
        return [method(worker, *args, **(kwargs or {})) for worker in self.workers]

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def layers(self) -> list[Attention]:
        return [m for worker in self.workers for m in worker.model.modules() if isinstance(m, Attention)]


@pytest.fixture(autouse=True)
def vllm_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the worker-side function imports inside the engine: vLLM's version."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def next_float32(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x), torch.tensor(1.0)))


def test_sent_scales_are_held_bit_for_bit_in_every_copy_and_the_prefix_cache_is_reset() -> None:
    engine = Engine()
    api.send_scales(engine, SENT)
    for layer in engine.layers():
        index = int(layer.layer_name.split(".")[2])
        k, v = SENT.k[index][0], SENT.v[index][0]
        assert [bits(x) for x in (layer._k_scale_float, float(layer._k_scale), float(layer._k_scale_cpu))] == [bits(k)] * 3
        assert [bits(x) for x in (layer._v_scale_float, float(layer._v_scale), float(layer._v_scale_cpu))] == [bits(v)] * 3
    assert engine.prefix_resets == 1
    check = api.check_engine_scales(engine, SENT)
    assert check.ok and (check.engine, check.engine_version, check.torch_version) == ("vllm", "0.32.0", torch.__version__)
    assert [(c.worker, c.copy) for c in check.copies] == [(0, "float"), (0, "tensor"), (0, "host")]
    assert [(row.layer, row.file_k, row.held_k) for row in check.copies[1].layers] == [
        (i, SENT.k[i][0], SENT.k[i][0]) for i in range(4)]
    assert api.render_engine_check(check).endswith("every layer holds the sent scales in every copy")


def test_a_dropped_update_is_caught_with_the_scales_the_layers_still_hold() -> None:
    engine = Engine()
    api.send_scales(engine, OTHER)
    check = api.check_engine_scales(engine, SENT)  # SENT was meant to go, OTHER is what the engine got
    assert not check.ok and not any(copy.ok for copy in check.copies)
    assert [(row.held_k, row.held_v) for row in check.copies[0].layers] == [(OTHER.k[i][0], OTHER.v[i][0]) for i in range(4)]
    text = api.render_engine_check(check)
    assert "worker 0 float: 4 of 4 layers hold other scales\n" in text
    assert text.endswith("NOT every layer holds the sent scales")


def test_scales_that_never_arrived_read_as_1_and_emptied_tensors_as_0() -> None:
    engine = Engine()
    never = api.check_engine_scales(engine, SENT)
    assert "worker 0 tensor: 4 of 4 layers hold other scales, 1.0 each: the scales never arrived" in (
        api.render_engine_check(never))
    api.send_scales(engine, SENT)
    for layer in engine.layers():  # what a sleep that frees the tensors and a wake-up without a reload leave
        for tensor in (layer._k_scale, layer._v_scale, layer._k_scale_cpu, layer._v_scale_cpu):
            tensor.zero_()
    emptied = api.check_engine_scales(engine, SENT)
    assert [(c.copy, c.ok) for c in emptied.copies] == [("float", True), ("tensor", False), ("host", False)]
    assert "worker 0 host: 4 of 4 layers hold other scales, 0.0 each: the scale tensors were emptied and not refilled" in (
        api.render_engine_check(emptied))


def test_one_float32_step_off_in_one_copy_is_not_held() -> None:
    engine = Engine()
    api.send_scales(engine, SENT)
    engine.layers()[2]._v_scale_float = next_float32(SENT.v[2][0])
    check = api.check_engine_scales(engine, SENT)
    assert [(c.copy, c.ok) for c in check.copies] == [("float", False), ("tensor", True), ("host", True)]
    assert [row.matches for row in check.copies[0].layers] == [True, True, False, True]
    assert f"| 2 | {SENT.k[2][0]!r} | {SENT.v[2][0]!r} | k {SENT.k[2][0]!r}, v {next_float32(SENT.v[2][0])!r} | yes | yes |" in (
        api.render_engine_check(check))


def test_workers_holding_different_layers_are_each_checked_on_their_own() -> None:
    engine = Engine(range(0, 2), range(2, 4))  # pipeline stages
    api.send_scales(engine, SENT)
    check = api.check_engine_scales(engine, SENT)
    assert check.ok and [tuple(row.layer for row in c.layers) for c in check.copies] == [(0, 1)] * 3 + [(2, 3)] * 3
    assert "| 0 |" in api.render_engine_check(check) and "| - |" in api.render_engine_check(check)
    short = KVScales.from_floats(k={i: SENT.k[i][0] for i in (0, 1)}, v={i: SENT.v[i][0] for i in (0, 1)})
    missing = api.check_engine_scales(engine, short)  # none sent for layers 2 and 3
    assert [c.ok for c in missing.copies] == [True] * 3 + [False] * 3
    assert missing.copies[3].layers[0].file_k is None


def test_what_cannot_be_sent_is_one_clear_error() -> None:
    engine = Engine()
    per_head = KVScales.from_floats(k={i: [0.01, 0.02] for i in range(4)}, v={i: [0.03, 0.04] for i in range(4)})
    with pytest.raises(Fp8kvError, match=re.escape("send_scales: per-head scales; vLLM's CPU and Triton attention")):
        api.send_scales(engine, per_head)
    with pytest.raises(Fp8kvError, match=re.escape("send_scales: the scales do not cover the engine's attention layers [2, 3]")):
        api.send_scales(engine, KVScales.from_floats(k={0: 0.5, 1: 0.5}, v={0: 0.5, 1: 0.5}))
    with pytest.raises(Fp8kvError, match="expected a ScaleSet .* got dict"):
        api.check_engine_scales(engine, {0: (0.5, 0.5)})  # type: ignore[arg-type]
    assert [layer._k_scale_float for layer in engine.layers()] == [1.0] * 4  # nothing was half sent


def test_the_documented_rl_loop_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/api.md's second example, with `vllm.LLM` standing in as an engine of the saved folder's layers."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    example = re.findall(r"```python\n(.*?)```", text, re.S)[1]
    assert 'model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"' in example
    llama = make_checkpoint("llama", tmp_path / "llama", num_layers=3)
    engines: list[Engine] = []

    def llm(folder: str, **options: Any) -> Engine:
        assert options["kv_cache_dtype"] == "fp8" and (Path(folder) / "fp8kv.json").exists()
        engines.append(Engine(range(3)))
        return engines[-1]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0", LLM=llm))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the example sets it: restored after
    monkeypatch.chdir(tmp_path)
    exec(compile(example.replace("HuggingFaceTB/SmolLM2-135M-Instruct", str(llama)), "docs/api.md", "exec"), {})
    (engine,) = engines
    assert engine.methods_called == ["reload_weights"] * 3 and engine.prefix_resets == 3
    assert all(layer._k_scale_float != 1.0 for layer in engine.layers())
