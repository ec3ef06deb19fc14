"""Per-layer K/V scales: the one value type every checkpoint convention reads into and writes from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import FP8_MAX
from fp8kv.options import DEFAULT_KV_DTYPE


@dataclass(frozen=True)
class KVScales:
    """Dequantization scales for the K and V cache of every cache-owning layer.

    `k[layer]` / `v[layer]` are float32 tensors of shape `[1]` (the "tensor" strategy) or
    `[num_kv_heads, 1, 1]` (the "attn_head" strategy); `x ≈ float(fp8) * scale`.
    `q[layer]` (optional, float32 `[1]`) scales the query for fp8 attention: the kernel reads
    `fp8(q / q_scale)` and multiplies `q_scale` back into the scores.
    """

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    kv_dtype: str = DEFAULT_KV_DTYPE
    q: dict[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype not in FP8_MAX:
            raise Fp8kvError(f"kv dtype {self.kv_dtype!r} is not supported; use one of {', '.join(FP8_MAX)}")
        if sorted(self.k) != sorted(self.v):
            raise Fp8kvError(
                f"K scales cover layers {sorted(self.k)} but V scales cover {sorted(self.v)}; "
                "every layer needs both"
            )
        if not self.k:
            raise Fp8kvError("no K/V scales were given")
        shapes = {tuple(t.shape) for t in (*self.k.values(), *self.v.values())}
        if len(shapes) != 1:
            raise Fp8kvError(f"K/V scales mix shapes {sorted(shapes)}; use one strategy for every layer")
        (shape,) = shapes
        if shape != (1,) and not (len(shape) == 3 and shape[1:] == (1, 1)):
            raise Fp8kvError(f"K/V scale shape {list(shape)} is neither [1] nor [num_kv_heads, 1, 1]")
        if self.q is not None:
            if sorted(self.q) != sorted(self.k):
                raise Fp8kvError(f"Q scales cover layers {sorted(self.q)} but K/V scales cover {sorted(self.k)}")
            if any(t.shape != (1,) for t in self.q.values()):
                raise Fp8kvError("Q scales must have shape [1] (one per layer)")
        for name, table in (("K", self.k), ("V", self.v), ("Q", self.q or {})):
            for layer, tensor in table.items():
                if tensor.dtype != torch.float32:
                    raise Fp8kvError(f"layer {layer}: {name} scale has dtype {tensor.dtype}, expected float32")

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers that have scales, ascending."""
        return tuple(sorted(self.k))

    @property
    def strategy(self) -> str:
        """"tensor" for one scale per layer, "attn_head" for one per KV head."""
        return "tensor" if next(iter(self.k.values())).shape == (1,) else "attn_head"

    @property
    def fp8_max(self) -> float:
        """The largest finite value of the kv dtype."""
        return FP8_MAX[self.kv_dtype]

    def values(self, layer: int) -> tuple[list[float], list[float]]:
        """K and V scales of `layer` as Python floats (one per head for attn_head)."""
        return self.k[layer].flatten().tolist(), self.v[layer].flatten().tolist()

    def q_value(self, layer: int) -> float | None:
        """The query scale of `layer`, or None when the checkpoint has none."""
        return None if self.q is None else float(self.q[layer])

    def rows(self) -> list[dict[str, object]]:
        """One JSON-ready row per layer: k_scale and v_scale, each a float or a list (one per head)."""
        rows = []
        for layer in self.layers:
            k, v = self.values(layer)
            rows.append({"layer": layer, "k_scale": k[0] if len(k) == 1 else k, "v_scale": v[0] if len(v) == 1 else v})
        return rows

    def problems(self) -> list[str]:
        """Layers whose scales are zero, negative or not finite, one line each."""
        lines = []
        for layer in self.layers:
            q = [] if self.q is None else [self.q[layer].tolist()]
            for name, vals in zip(("k_scale", "v_scale", "q_scale"), (*self.values(layer), *q)):
                bad = [x for x in vals if not (math.isfinite(x) and x > 0)]
                if bad:
                    lines.append(f"layer {layer}: {name} {bad[0]!r} is not a positive finite number")
        return lines

    @classmethod
    def from_floats(
        cls, k: dict[int, float | list[float]], v: dict[int, float | list[float]], kv_dtype: str = DEFAULT_KV_DTYPE
    ) -> KVScales:
        """Build scales from plain numbers: a float per layer ("tensor") or a list per head ("attn_head")."""
        return cls(k={i: _tensor(x) for i, x in k.items()}, v={i: _tensor(x) for i, x in v.items()}, kv_dtype=kv_dtype)


def _tensor(value: float | list[float]) -> torch.Tensor:
    if isinstance(value, (int, float)):
        return torch.tensor([float(value)], dtype=torch.float32)
    return torch.tensor([float(x) for x in value], dtype=torch.float32).reshape(-1, 1, 1)
