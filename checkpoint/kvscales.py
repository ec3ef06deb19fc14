"""Per-layer K/V scales: the one value type every checkpoint convention reads into and writes from.

The values are plain Python floats (each one a float32 value), so reading and checking scales needs no
torch; `tensor` hands the writer, the runtime and verify the float32 tensor a file stores.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import SCALE_BOUND
from fp8kv.options import DEFAULT_KV_DTYPE

if TYPE_CHECKING:
    import torch

STRATEGIES = ("tensor", "attn_head")
# A scale tensor's shape and its values, flattened: how a file stores one layer's K, V or Q scale.
Shaped = tuple[tuple[int, ...], tuple[float, ...]]


@dataclass(frozen=True)
class KVScales:
    """Dequantization scales for the K and V cache of every cache-owning layer.

    `k[layer]` / `v[layer]` are float32 values: one (`strategy` "tensor", stored as shape `[1]`) or one
    per KV head ("attn_head", stored as `[num_kv_heads, 1, 1]`); `x ≈ float(fp8) * scale`.
    `q[layer]` (optional, one value) scales the query for fp8 attention: the kernel reads
    `fp8(q / q_scale)` and multiplies `q_scale` back into the scores.
    """

    k: dict[int, tuple[float, ...]]
    v: dict[int, tuple[float, ...]]
    kv_dtype: str = DEFAULT_KV_DTYPE
    q: dict[int, float] | None = None
    strategy: str = "tensor"

    def __post_init__(self) -> None:
        if self.kv_dtype not in SCALE_BOUND:
            raise Fp8kvError(f"kv dtype {self.kv_dtype!r} is not supported; use one of {', '.join(SCALE_BOUND)}")
        if self.strategy not in STRATEGIES:
            raise Fp8kvError(f"scale strategy {self.strategy!r} is neither 'tensor' nor 'attn_head'")
        if sorted(self.k) != sorted(self.v):
            raise Fp8kvError(
                f"K scales cover layers {sorted(self.k)} but V scales cover {sorted(self.v)}; "
                "every layer needs both"
            )
        if not self.k:
            raise Fp8kvError("no K/V scales were given")
        shape = (1,) if self.strategy == "tensor" else (-1, 1, 1)
        strategy_of((len(x),) + shape[1:] for x in (*self.k.values(), *self.v.values()))
        if self.q is not None and sorted(self.q) != sorted(self.k):
            raise Fp8kvError(f"Q scales cover layers {sorted(self.q)} but K/V scales cover {sorted(self.k)}")
        for name, table in (("K", self.k), ("V", self.v), ("Q", {i: (x,) for i, x in (self.q or {}).items()})):
            for layer, values in table.items():
                if not all(isinstance(x, float) and (float32(x) == x or math.isnan(x)) for x in values):
                    raise Fp8kvError(f"layer {layer}: {name} scale {list(values)} is not float32 values")

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers that have scales, ascending."""
        return tuple(sorted(self.k))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape a file stores each K and V scale in: `[1]` or `[num_kv_heads, 1, 1]`."""
        return (1,) if self.strategy == "tensor" else (len(self.k[self.layers[0]]), 1, 1)

    @property
    def fp8_max(self) -> float:
        """The largest finite value of the kv dtype (NVFP4: the bound a calibrated amax maps to, kvdtypes.SCALE_BOUND)."""
        return SCALE_BOUND[self.kv_dtype]

    def values(self, layer: int) -> tuple[list[float], list[float]]:
        """K and V scales of `layer` as Python floats (one per head for attn_head)."""
        return list(self.k[layer]), list(self.v[layer])

    def q_value(self, layer: int) -> float | None:
        """The query scale of `layer`, or None when the checkpoint has none."""
        return None if self.q is None else self.q[layer]

    def tensor(self, part: str, layer: int) -> torch.Tensor:
        """The float32 tensor a file stores for `part` ("k", "v" or "q") of `layer`: `shape`, or `[1]` for q."""
        import torch

        values = (self.q_value(layer),) if part == "q" else {"k": self.k, "v": self.v}[part][layer]
        return torch.tensor(values, dtype=torch.float32).reshape((1,) if part == "q" else self.shape)

    def problems(self) -> list[str]:
        """Layers whose scales are zero, negative or not finite, one line each."""
        lines = []
        for layer in self.layers:
            q = [] if self.q is None else [[self.q[layer]]]
            for name, vals in zip(("k_scale", "v_scale", "q_scale"), (*self.values(layer), *q)):
                bad = [x for x in vals if not (math.isfinite(x) and x > 0)]
                if bad:
                    lines.append(f"layer {layer}: {name} {bad[0]!r} is not a positive finite number")
        return lines

    @classmethod
    def from_floats(
        cls, k: dict[int, float | list[float]], v: dict[int, float | list[float]], kv_dtype: str = DEFAULT_KV_DTYPE
    ) -> KVScales:
        """Build scales from plain numbers, rounded to float32: a float per layer ("tensor") or a list per head
        ("attn_head")."""

        def shaped(x: float | list[float]) -> Shaped:
            return ((1,), (float(x),)) if isinstance(x, (int, float)) else ((len(x), 1, 1), tuple(map(float, x)))

        return cls.from_shaped({i: shaped(x) for i, x in k.items()}, {i: shaped(x) for i, x in v.items()}, kv_dtype)

    @classmethod
    def from_shaped(cls, k: dict[int, Shaped], v: dict[int, Shaped], kv_dtype: str = DEFAULT_KV_DTYPE,
                    q: dict[int, Shaped] | None = None) -> KVScales:
        """Build scales from each layer's stored shape and values (rounded to float32), as a file holds them."""
        if q is not None and any(shape != (1,) for shape, _ in q.values()):
            raise Fp8kvError("Q scales must have shape [1] (one per layer)")
        strategy = strategy_of(shape for shape, _ in (*k.values(), *v.values())) if k else "tensor"

        def rounded(table: dict[int, Shaped]) -> dict[int, tuple[float, ...]]:
            return {i: tuple(float32(x) for x in values) for i, (_, values) in table.items()}

        queries = None if q is None else {i: values[0] for i, values in rounded(q).items()}
        return cls(rounded(k), rounded(v), kv_dtype, queries, strategy)

    @classmethod
    def from_tensors(cls, k: dict[int, Any], v: dict[int, Any], kv_dtype: str = DEFAULT_KV_DTYPE,
                     q: dict[int, Any] | None = None) -> KVScales:
        """Build scales from float32 tensors of shape `[1]` or `[num_kv_heads, 1, 1]` (q: `[1]`)."""

        def shaped(name: str, table: dict[int, Any]) -> dict[int, Shaped]:
            for layer, tensor in table.items():
                if str(tensor.dtype) != "torch.float32":
                    raise Fp8kvError(f"layer {layer}: {name} scale has dtype {tensor.dtype}, expected float32")
            return {i: (tuple(t.shape), tuple(t.flatten().tolist())) for i, t in table.items()}

        return cls.from_shaped(shaped("K", k), shaped("V", v), kv_dtype, None if q is None else shaped("Q", q))


def strategy_of(shapes: Iterable[tuple[int, ...]]) -> str:
    """"tensor" for scales of shape `[1]`, "attn_head" for `[num_kv_heads, 1, 1]`; mixed or other shapes refused."""
    found = set(shapes)
    if len(found) != 1:
        raise Fp8kvError(f"K/V scales mix shapes {sorted(found)}; use one strategy for every layer")
    (shape,) = found
    if shape != (1,) and not (len(shape) == 3 and shape[1:] == (1, 1) and shape[0] >= 1):
        raise Fp8kvError(f"K/V scale shape {list(shape)} is neither [1] nor [num_kv_heads, 1, 1]")
    return "tensor" if shape == (1,) else "attn_head"


def float32(value: float) -> float:
    """`value` rounded to the nearest float32 (beyond float32's range: infinity), as a Python float."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
