"""The paged KV cache: page allocator, slot mapping and quantized writes.

Layout per attention layer, as vLLM's TPU backend keeps it:
`[num_pages, page_size, 2 * num_kv_heads, head_dim_padded]`, K and V interleaved on the head axis
(combined head 2h is K of head h, 2h+1 is V of head h). Each layer has its own tensor, so layers
may differ in KV heads and head_dim (Gemma 4's global layers); all share one page table. A token's
flat slot is `page * page_size + offset`. Page 0 is a scratch page: padding tokens of a fixed-shape step write
there, and no sequence ever reads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.engine_models import DEFAULT_ENGINE, EngineModel, as_engine_model
from fp8kv.fp8 import is_fp8, nonfinite, reads_differently, to_float32

SCRATCH_PAGE = 0

Scale = float | Sequence[float]


class PageAllocator:
    """Hands out cache pages to sequences and keeps their page tables and lengths (host side).

    Pages are reference counted so a sequence can share the full pages of another's prefix.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise Fp8kvError(f"the cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.page_size = page_size
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refs = [0] * num_pages
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def add(self, seq_id: int, share_from: int | None = None, shared_tokens: int = 0) -> int:
        """Register `seq_id`; optionally share the full pages holding `shared_tokens` of `share_from`.

        Returns the number of tokens actually shared (rounded down to whole pages): the caller
        computes the sequence from there on.
        """
        if seq_id in self.tables:
            raise Fp8kvError(f"sequence {seq_id} already exists")
        table: list[int] = []
        if share_from is not None:
            shared_tokens = min(shared_tokens, self.lengths[share_from])
            table = self.tables[share_from][: shared_tokens // self.page_size]
            for page in table:
                self._refs[page] += 1
        self.tables[seq_id] = table
        self.lengths[seq_id] = len(table) * self.page_size
        return self.lengths[seq_id]

    def extend(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve room for `num_tokens` more tokens of `seq_id`; returns their flat slots."""
        start = self.lengths[seq_id]
        end = start + num_tokens
        table = self.tables[seq_id]
        while len(table) * self.page_size < end:
            if not self._free:
                raise Fp8kvError("the KV cache is full; raise --num-pages or shorten the requests")
            page = self._free.pop()
            self._refs[page] = 1
            table.append(page)
        self.lengths[seq_id] = end
        ps = self.page_size
        return [table[pos // ps] * ps + pos % ps for pos in range(start, end)]

    def free(self, seq_id: int) -> None:
        """Release a sequence's pages (shared pages stay until their last user frees them)."""
        for page in self.tables.pop(seq_id):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        del self.lengths[seq_id]


@dataclass(frozen=True)
class CacheCounts:
    """A cache's counters per KV layer: `(K, V)` counts of values clamped at ±MAX and of NaN/inf values
    stored, how many values were written to K (as many to V), and `(K, V)` max |x| per KV head of the
    values handed to the cache (before any scale; NaN once one was NaN)."""

    clamped: dict[int, tuple[int, int]]
    nonfinite: dict[int, tuple[int, int]]
    written: dict[int, int]
    amax: dict[int, tuple[tuple[float, ...], tuple[float, ...]]]


@dataclass(frozen=True)
class ForwardCounts:
    """What the writes of one forward did, per token (int64 on the cache device): `over` `[T]` counts values past
    the fp8 maximum, `shadow_diffs` `[shadows, T]` the values each shadow engine would have stored differently."""

    over: torch.Tensor
    shadow_diffs: torch.Tensor


class PagedLayers:
    """What the paged K/V cache and the latent cache share: one page tensor per KV layer (`pages`, row `i`
    for `kv_layers[i]`), the row copy into and out of them, and the counters on the cache device (int64
    `clamped`, `nonfinite` `[num_kv_layers, 2]` for K and V, `written` `[num_kv_layers]`; float32 `amax`
    `[num_kv_layers, 2, kv_heads]`, a layer with fewer heads filling the first slots; `forward`, the
    per-token counts of the forward `start_forward` began, None before one).

    `shadows` are the engine models the cache also computes every write for (`shadow_models`).
    """

    shadows: tuple[EngineModel, ...]

    def __init__(self, kv_layers: Sequence[int], pages: list[torch.Tensor], device: torch.device,
                 heads: Sequence[int]) -> None:
        self.kv_layers = tuple(kv_layers)
        self.pages = pages
        self._row = {layer: i for i, layer in enumerate(self.kv_layers)}
        self._amax_heads = tuple(heads)
        self._device = device
        self.forward: ForwardCounts | None = None
        self.clamped = torch.zeros(len(self.kv_layers), 2, dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros(len(self.kv_layers), 2, dtype=torch.int64, device=device)
        self.written = torch.zeros(len(self.kv_layers), dtype=torch.int64, device=device)
        self.amax = torch.zeros(len(self.kv_layers), 2, max(heads, default=1), dtype=torch.float32, device=device)

    def start_forward(self, tokens: int) -> ForwardCounts:
        """Zeroed per-token counters for the writes of the next forward (of `tokens` tokens), also `forward`."""
        self.forward = ForwardCounts(torch.zeros(tokens, dtype=torch.int64, device=self._device),
                                     torch.zeros(len(self.shadows), tokens, dtype=torch.int64, device=self._device))
        return self.forward

    def _fold_amax(self, row: int, amax: torch.Tensor) -> None:
        """Fold one write's max |K| and |V| per head (`[2, heads]`) into row `row`'s amax.

        torch's max keeps a NaN, so a NaN handed to the cache shows in its amax.
        """
        heads = amax.shape[1]
        self.amax[row, :, :heads] = torch.maximum(self.amax[row, :, :heads], amax)

    def _store(self, row: int, slots: torch.Tensor, stored: torch.Tensor) -> None:
        """`stored` `[T, ...]` into row `row`'s pages at flat `slots` `[T]`."""
        store_rows(self.pages[row].flatten(0, 1), slots, stored)

    def _load(self, row: int, slots: torch.Tensor) -> torch.Tensor:
        return load_rows(self.pages[row].flatten(0, 1), slots)

    def bytes_per_token(self) -> float:
        """Cache bytes one token occupies across all layers (padding included)."""
        return float(sum(pages[0, 0].numel() * pages.element_size() for pages in self.pages))

    def counts(self) -> CacheCounts:
        """The counters, read from the device once."""
        clamped, nonfinite, written = self.clamped.cpu().tolist(), self.nonfinite.cpu().tolist(), self.written.cpu().tolist()
        amax = self.amax.cpu().tolist()
        return CacheCounts(
            clamped={layer: (clamped[i][0], clamped[i][1]) for i, layer in enumerate(self.kv_layers)},
            nonfinite={layer: (nonfinite[i][0], nonfinite[i][1]) for i, layer in enumerate(self.kv_layers)},
            written={layer: written[i] for i, layer in enumerate(self.kv_layers)},
            amax={layer: (tuple(amax[i][0][:heads]), tuple(amax[i][1][:heads]))
                  for i, (layer, heads) in enumerate(zip(self.kv_layers, self._amax_heads))},
        )


class PagedKVCache(PagedLayers):
    """One preallocated cache tensor per KV layer, quantized writes, and overflow counters.

    `k_scales`/`v_scales` map each KV layer index to a float or a per-KV-head list of floats
    (dequantization multipliers); None means 1.0 everywhere. Scales only apply to fp8 caches. The cache
    holds them as one table, `scales` `[num_kv_layers, 2 (K, V), kv_heads]` float32 on its device.
    `engine` names the engine model whose write (and loaded scales) the cache reproduces (`fp8kv.engine_models`).
    `num_kv_heads` and `head_dim` are one value for every layer or one per KV layer (in `kv_layers` order);
    the attributes of those names hold the largest, `layer_kv_heads(layer)` / `layer_head_dim(layer)` each layer's.
    `shared_layers` maps each layer that reads another's cache (KV sharing) to that layer (`owner`).
    Counters (int64 tensors on the cache device, `[num_kv_layers, 2]` for K and V):
    `clamped` counts values with |x / scale| > MAX, `nonfinite` counts NaN/inf values stored.
    """

    # Whether the attention writes its output in fp8 e4m3 (at scale 1) before the model reads it back
    fp8_attention_output = False

    def __init__(
        self,
        kv_layers: Sequence[int],
        *,
        num_pages: int,
        page_size: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int | Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        head_dim_multiple: int = 1,
        k_scales: Mapping[int, Scale] | None = None,
        v_scales: Mapping[int, Scale] | None = None,
        engine: str | EngineModel = DEFAULT_ENGINE,
        shared_layers: Mapping[int, int] | None = None,
        shadows: Sequence[str | EngineModel] = (),
    ) -> None:
        kv_layers = tuple(kv_layers)
        self.shared_layers = dict(shared_layers or {})  # KV sharing: reading layer -> the layer owning the cache
        self.page_size = page_size
        self._kv_heads = _per_layer(num_kv_heads, kv_layers, "num_kv_heads")
        self._head_dims = _per_layer(head_dim, kv_layers, "head_dim")
        self.num_kv_heads, self.head_dim = max(self._kv_heads), max(self._head_dims)
        self._padded = [math.ceil(d / head_dim_multiple) * head_dim_multiple for d in self._head_dims]
        self.head_dim_padded = max(self._padded)
        self.dtype = dtype
        self.engine = as_engine_model(engine)
        self.shadows = shadow_models(self.engine, shadows)
        k_scales, v_scales = self.engine.loads(k_scales, v_scales)
        k_given = layer_scales(k_scales, kv_layers, self._kv_heads, "k_scale")
        v_given = layer_scales(v_scales, kv_layers, self._kv_heads, "v_scale")
        # a layer with fewer KV heads than the largest repeats its last value in the padding of its row
        table = torch.tensor([[_padded_row(k, heads, self.num_kv_heads), _padded_row(v, heads, self.num_kv_heads)]
                              for k, v, heads in zip(k_given, v_given, self._kv_heads)], dtype=torch.float32)
        # torch_xla's attention takes a per-layer scale only as a Python float (a constant of its graph),
        # so those are read out of the table once here; None marks a per-head scale, passed as a tensor.
        self._scale_floats = [tuple(row[i][0] if len(given) == 1 else None for i, given in enumerate(pair))
                              for row, pair in zip(table.tolist(), zip(k_given, v_given))]
        self.scales = table.to(device)
        # [num_kv_layers, 2*kv_heads, 1]: K0, V0, K1, V1, ... like the cache's combined heads
        self._write_scales = self.scales.transpose(1, 2).reshape(len(kv_layers), 2 * self.num_kv_heads, 1)
        self.num_pages = num_pages
        # One tensor per layer, not views of one [layers, ...] tensor: on XLA an in-place write into a view
        # of the big tensor measured 0.68x fp8 decode (bench/bench_runtime.py, bench/README.md: Runtime).
        super().__init__(kv_layers, [torch.zeros((num_pages, page_size, 2 * heads, padded), dtype=dtype, device=device)
                                     for heads, padded in zip(self._kv_heads, self._padded)], device, self._kv_heads)

    def owner(self, layer: int) -> int:
        """The cache layer `layer` attends over: itself, or the layer whose cache it shares."""
        owner = self.shared_layers.get(layer, layer)
        if owner not in self._row:
            raise Fp8kvError(f"layer {layer} has no K/V cache here: it owns none and shares none "
                             f"(cache layers {list(self.kv_layers)}, shared {self.shared_layers})")
        return owner

    def layer_kv_heads(self, layer: int) -> int:
        """KV heads of the cache `layer` attends over."""
        return self._kv_heads[self._row[self.owner(layer)]]

    def layer_head_dim(self, layer: int) -> int:
        """head_dim (before padding) of the cache `layer` attends over."""
        return self._head_dims[self._row[self.owner(layer)]]

    def layer_pages(self, layer: int) -> torch.Tensor:
        """The `[num_pages, page_size, 2*kv_heads, head_dim_padded]` cache `layer` attends over (its owner's)."""
        return self.pages[self._row[self.owner(layer)]]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Quantize and store K/V of `[tokens, kv_heads, head_dim]` at flat `slots` `[tokens]`.

        `valid` `[tokens]` (bool) marks real tokens; padding tokens go to the scratch page and are not counted.
        """
        row = self._row[layer]
        heads = self._kv_heads[row]
        kv = torch.stack([k, v], dim=2).flatten(1, 2)  # [T, 2*kv_heads, head_dim]
        kv = torch.nn.functional.pad(kv, (0, self._padded[row] - self._head_dims[row]))
        stored = self.engine.write(kv, self._write_scales[row, : 2 * heads], self.dtype) if is_fp8(self.dtype) \
            else kv.to(self.dtype)
        self._count(row, kv, stored, valid)
        if self.forward is not None and self.shadows and is_fp8(self.dtype):
            scales = self._write_scales[row, : 2 * heads]
            self.forward.shadow_diffs.add_(shadow_differences(self.shadows, kv, scales, stored, valid[:, None, None]))
        self._store(row, slots, stored)

    def _count(self, row: int, kv: torch.Tensor, stored: torch.Tensor, valid: torch.Tensor) -> None:
        heads, real = self._kv_heads[row], valid[:, None]
        # one float32 copy, made absolute in place: each new temporary of a prefill's size costs more than its pass
        magnitude = to_float32(kv).abs_()  # [T, 2*kv_heads, d]
        # combined heads K0, V0, K1, V1, ...: each token's largest per head, padding tokens' taken as 0
        self._fold_amax(row, torch.where(real, magnitude.amax(dim=2), 0.0).amax(dim=0).view(heads, 2).T)

        def per_token(found: torch.Tensor) -> torch.Tensor:
            """`found` [T, 2*kv_heads, d] counted per token for K and V: [T, 2], 0 for padding tokens."""
            return found.view(found.shape[0], heads, 2, -1).sum(dim=(1, 3), dtype=torch.int32) * real

        if self.clamps:
            over = per_token(magnitude.div_(self._write_scales[row, : 2 * heads]) > torch.finfo(self.dtype).max)
            self.clamped[row] += over.sum(dim=0)
            if self.forward is not None:
                self.forward.over.add_(over.sum(dim=1))
        self.nonfinite[row] += per_token(nonfinite(stored)).sum(dim=0)
        self.written[row] += valid.sum() * heads * self._head_dims[row]

    @property
    def clamps(self) -> bool:
        """Whether a write clamps x / scale at the cache dtype's maximum (an fp8 cache): what `clamped` counts."""
        return is_fp8(self.dtype)

    def scale_args(self, layer: int) -> tuple[float | torch.Tensor | None, float | torch.Tensor | None]:
        """The (k_scale, v_scale) attention needs: floats, per-head tensors, or None for non-fp8 caches."""
        if not is_fp8(self.dtype):
            return None, None
        row = self._row[layer]
        heads = self._kv_heads[row]
        k, v = (self.scales[row, i, :heads] if value is None else value
                for i, value in enumerate(self._scale_floats[row]))
        return k, v


def shadow_models(engine: EngineModel, names: Sequence[str | EngineModel]) -> tuple[EngineModel, ...]:
    """The engine models a cache also computes every write for, to count where their values would differ.

    Only engines that read what they wrote with the same scales in the same format qualify: where every
    stored value is the same, their attention reads the same numbers, so their logits are the same.
    """
    shadows = tuple(as_engine_model(name) for name in names)
    for shadow in shadows:
        if (shadow.loads, shadow.cache, shadow.written) != (engine.loads, engine.cache, engine.written):
            raise Fp8kvError(f"engine {shadow.name} runs other scales or another cache format than {engine.name}: "
                             "its writes cannot be compared value by value")
    return shadows


def shadow_differences(shadows: tuple[EngineModel, ...], x: torch.Tensor, scale: torch.Tensor, stored: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Per shadow engine and token of `x` `[T, ...]`, how many values it would store differently from `stored`
    (`[len(shadows), T]`).

    Values compare as the attention reads them (a NaN equals a NaN); `mask` (broadcast to `x`) marks real tokens.
    """
    counts = []
    for shadow in shadows:
        other = shadow.write(x, scale, stored.dtype)
        counts.append((reads_differently(other, stored) & mask).flatten(1).sum(1))
    return torch.stack(counts)


def store_rows(flat: torch.Tensor, slots: torch.Tensor, stored: torch.Tensor) -> None:
    """`flat[slots] = stored` along dim 0, for a cache tensor of any dtype.

    CPU torch 2.9 has no fp8 index_copy_, so bytes are copied there; XLA copies fp8 natively, and a
    dtype view on XLA would fall back to the CPU and round-trip the cache through the host.
    """
    if is_fp8(flat.dtype) and flat.device.type != "xla":
        flat.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, stored)


def page_slots(page_indices: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The flat cache slot of each of `positions` in the pages `page_indices` (`[..., pages_per_seq]`) list, in
    order: `[..., len(positions)]`."""
    return page_indices.long()[..., positions // page_size] * page_size + positions % page_size


def load_rows(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`flat[slots]` along dim 0 (CPU torch 2.9 cannot gather fp8 either: bytes are read there)."""
    if is_fp8(flat.dtype) and flat.device.type != "xla":
        return flat.view(torch.uint8).index_select(0, slots).view(flat.dtype)
    return flat.index_select(0, slots)


def _per_layer(value: int | Sequence[int], kv_layers: tuple[int, ...], name: str) -> list[int]:
    """One size per KV layer: `value` for all of them, or the list given (which must have one per layer)."""
    values = [value] * len(kv_layers) if isinstance(value, int) else list(value)
    if len(values) != len(kv_layers):
        raise Fp8kvError(f"{name}: {len(values)} values for {len(kv_layers)} KV layers; give one, or one per layer")
    return values


def _padded_row(values: list[float], heads: int, width: int) -> list[float]:
    """A layer's scale once per KV head, repeated to `heads`, then its last value to the table's `width`."""
    row = values * (heads // len(values))
    return row + row[-1:] * (width - heads)


def layer_scales(
    scales: Mapping[int, Scale] | None, kv_layers: tuple[int, ...], kv_heads: list[int], name: str
) -> list[list[float]]:
    """Per KV layer (in `kv_layers` order) its validated scale: one value, or one per KV head of that layer."""
    if scales is None:
        return [[1.0] for _ in kv_layers]
    missing = sorted(set(kv_layers) - set(scales))
    unexpected = sorted(set(scales) - set(kv_layers))
    if missing or unexpected:
        raise Fp8kvError(f"{name}: layers missing {missing}, unexpected {unexpected}; give one per KV layer")
    out = []
    for layer, num_kv_heads in zip(kv_layers, kv_heads):
        value = scales[layer]
        values = [float(value)] if isinstance(value, (int, float)) else [float(s) for s in value]
        if len(values) not in (1, num_kv_heads):
            raise Fp8kvError(f"{name} of layer {layer}: {len(values)} values; give 1 or {num_kv_heads}")
        if not all(math.isfinite(s) and s > 0 for s in values):
            raise Fp8kvError(f"{name} of layer {layer}: {values} must be finite and > 0")
        out.append(values)
    return out
