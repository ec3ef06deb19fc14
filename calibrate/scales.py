"""Scale math: from observed K/V statistics to float32 dequantization scales.

`scale = amax / MAX` (a dequantization multiplier: x ≈ float(fp8) * scale) is `scale_from_amax`, the one
place the formula lives. A strategy only chooses the value that maps to MAX (the clip value): the
observed amax (default, nothing saturates), a percentile of |x|, the clip that minimises the squared
fp8 quantization error on the histogram, or the amax of the last calibration batch alone
(`last-batch`, llm-compressor's default kv-cache observer `memoryless_minmax`: it recomputes the scale
from every forward's K/V and the last forward wins; its default batch is one sample). Percentile, mse
and last-batch clip below the amax; only `amax` guarantees amax / scale <= MAX.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8kv.observe import BINS_PER_OCTAVE, KVStatistics, bin_edges
from fp8kv.fp8 import FP8_DTYPES
from fp8kv.kvdtypes import SCALE_BOUND
from fp8kv.errors import Fp8kvError
from fp8kv.options import LAST_BATCH, Strategy, check_headroom

MSE_CANDIDATES = 256  # clip candidates amax * 2**(-j/32), j < 256: down to amax / 256


def fp8_max(kv_dtype: str) -> float:
    """The |x| / scale a calibrated clip maps to: the largest finite value of an fp8 KV-cache dtype (448 for
    fp8_e4m3, 57344 for fp8_e5m2); 448 for the NVFP4 ones, whose global scale ModelOpt defines as amax / 448."""
    if kv_dtype not in SCALE_BOUND:
        raise Fp8kvError(f"unknown kv dtype {kv_dtype!r}; choose one of {', '.join(SCALE_BOUND)}")
    return SCALE_BOUND[kv_dtype]


def scale_from_amax(amax: torch.Tensor, kv_dtype: str = "fp8_e4m3", headroom: float = 1.0) -> torch.Tensor:
    """`scale = amax / MAX * headroom` in float32, rounded up so that amax / scale <= MAX holds.

    Division rounds to nearest, which can land one float32 step below amax / MAX; the stored scale
    is then moved up with nextafter until the bound holds exactly (checked in float64) and as the
    float32 division a runtime performs.
    """
    check_headroom(headroom)
    limit = fp8_max(kv_dtype)
    amax32 = amax.to(torch.float32)
    scale = amax32 / limit * headroom
    for _ in range(4):
        low = (amax32.double() > scale.double() * limit) | (amax32 / scale > limit)
        if not bool(low.any()):
            break
        scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return scale


def clip_values(amax: torch.Tensor, hist: torch.Tensor, strategy: Strategy, kv_dtype: str) -> torch.Tensor:
    """The clip value per entry: `amax` [...], `hist` [..., NUM_BINS] -> float32 [...].

    `last-batch` is resolved by `compute_scales` (it needs the last batch's statistics).
    """
    if strategy.name in ("amax", LAST_BATCH):
        return amax.float()
    if strategy.name == "percentile":
        return torch.minimum(_percentile(hist, strategy.percentile / 100.0), amax.float())
    flat_amax, flat_hist = amax.reshape(-1).float(), hist.reshape(-1, hist.shape[-1])
    best = [_mse_clip(a, h, kv_dtype) for a, h in zip(flat_amax, flat_hist)]
    return torch.stack(best).view(amax.shape)


def _percentile(hist: torch.Tensor, share: float) -> torch.Tensor:
    """Upper edge of the first bin where the cumulative share of counts reaches `share`."""
    counts = hist.double().cumsum(-1)
    total = counts[..., -1:]
    first = torch.searchsorted(counts, total * share).clamp(max=hist.shape[-1] - 1)
    return bin_edges()[1:][first.squeeze(-1)].float()


def _mse_clip(amax: torch.Tensor, hist: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """The candidate clip with the least squared fp8 round-trip error over the histogram [NUM_BINS]."""
    if amax <= 0 or not torch.isfinite(amax):
        return amax
    edges = bin_edges()
    used = hist > 0
    x = (edges[:-1] * edges[1:]).sqrt()[used].clamp(max=float(amax))  # bin midpoints, [bins_used]
    weight = hist[used].double()
    steps = torch.arange(MSE_CANDIDATES, dtype=torch.float64) / BINS_PER_OCTAVE
    clips = float(amax) * torch.exp2(-steps)  # [candidates]
    limit = fp8_max(kv_dtype)
    scale = (clips / limit)[:, None]
    # Clamp before the cast: torch's fp8 cast does not saturate (fp8.RAW_CAST_FINITE_LIMIT).
    stored = (x[None, :] / scale).clamp(max=limit).to(FP8_DTYPES[kv_dtype]).double()
    error = ((stored * scale - x[None, :]) ** 2 * weight).sum(-1)
    return clips[int(error.argmin())].float()


def saturation_share(hist: torch.Tensor, amax: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Share of values with |x| > threshold: `hist` [..., NUM_BINS], `amax`/`threshold` [...] -> float64 [...].

    Exactly 0 where threshold >= amax; otherwise a histogram estimate (bins are 2**(1/32) wide,
    a bin counts when its geometric midpoint lies above the threshold).
    """
    edges = bin_edges()
    mid = (edges[:-1] * edges[1:]).sqrt()
    above = (mid > threshold.double()[..., None]) & (threshold < amax)[..., None]
    total = hist.double().sum(-1).clamp(min=1)
    return (hist.double() * above).sum(-1) / total


@dataclass(frozen=True)
class ScaleTable:
    """Scales for the layers that own a cache.

    `amax`: float32 [layers, 2, kv_heads] (index 0 = K, 1 = V); `clip`: float32 [layers, 2, G], the
    |x| the strategy chose to map to MAX, with G = kv_heads per head or 1 per tensor; `scales`:
    float32 [layers, 2, G] = `scale_from_amax(clip, kv_dtype, headroom)` except in `defaulted`
    layers (1.0: nothing was observed, only with allow_unobserved); `saturation`: float64 [layers, 2].
    """

    layers: tuple[int, ...]
    amax: torch.Tensor
    clip: torch.Tensor
    headroom: float
    scales: torch.Tensor
    saturation: torch.Tensor
    per_head: bool
    defaulted: tuple[int, ...]

    def tensors(self, kind: int) -> dict[int, torch.Tensor]:
        """Layer -> scale tensor for K (kind 0) or V (kind 1): shape [1], or [kv_heads, 1, 1] per head."""
        shape = (-1, 1, 1) if self.per_head else (1,)
        return {layer: self.scales[i, kind].reshape(shape).clone() for i, layer in enumerate(self.layers)}


def compute_scales(
    statistics: KVStatistics,
    layers: tuple[int, ...],
    *,
    kv_dtype: str = "fp8_e4m3",
    strategy: Strategy = Strategy("amax"),
    headroom: float = 1.0,
    per_head: bool = False,
    allow_unobserved: bool = False,
    last_batch: KVStatistics | None = None,
) -> ScaleTable:
    """Scales for `layers` from `statistics`, refusing zero, non-finite or never-observed layers.

    `last_batch`: the statistics of the final calibration batch alone, required by `last-batch`.
    """
    stats = statistics.cpu()
    amax, hist = stats.amax[list(layers)], stats.hist[list(layers)]  # [n, 2, H], [n, 2, H, bins]
    group_amax = _grouped_amax(amax, per_head)  # [n, 2, G]
    group_hist = hist if per_head else hist.sum(-2, keepdim=True)  # [n, 2, G, bins]
    unobserved = stats.tokens[list(layers)] == 0
    defaulted = _check_observed(layers, group_amax, unobserved, allow_unobserved)
    clip_amax = group_amax
    if strategy.name == LAST_BATCH:
        if last_batch is None:
            raise Fp8kvError("--strategy last-batch needs the statistics of the last calibration batch")
        clip_amax = _grouped_amax(last_batch.cpu().amax[list(layers)], per_head)
    clip = clip_values(clip_amax, group_hist, strategy, kv_dtype)
    scales = scale_from_amax(clip, kv_dtype, headroom)
    scales[_indices(layers, defaulted)] = 1.0
    threshold = scales.double() * fp8_max(kv_dtype)
    over = saturation_share(group_hist, group_amax, threshold) * group_hist.sum(-1)  # values over, [n, 2, G]
    saturation = over.sum(-1) / group_hist.sum((-1, -2)).clamp(min=1)
    return ScaleTable(layers, amax, clip, headroom, scales, saturation, per_head, defaulted)


def _grouped_amax(amax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """[n, 2, kv_heads] -> [n, 2, G]: per head, or the max over heads."""
    return amax if per_head else amax.amax(-1, keepdim=True)


def _indices(layers: tuple[int, ...], chosen: tuple[int, ...]) -> list[int]:
    return [i for i, layer in enumerate(layers) if layer in chosen]


def _check_observed(
    layers: tuple[int, ...], amax: torch.Tensor, unobserved: torch.Tensor, allow: bool
) -> tuple[int, ...]:
    """Raise unless every layer has finite, non-zero amax; return layers allowed to default to 1.0."""
    nonfinite = [layer for i, layer in enumerate(layers) if not bool(torch.isfinite(amax[i]).all())]
    never = [layer for i, layer in enumerate(layers) if bool(unobserved[i])]
    zero = [layer for i, layer in enumerate(layers) if layer not in never and bool((amax[i] == 0).any())]
    if nonfinite:
        raise Fp8kvError(
            f"no checkpoint written: K/V amax is NaN or infinite in layers {nonfinite}; "
            "the model overflows in this dtype (try --dtype float32)"
        )
    if (zero or never) and not allow:
        parts = ([f"all-zero K or V in layers {zero}"] if zero else []) + (
            [f"layers {never} were never observed"] if never else []
        )
        raise Fp8kvError(
            f"no checkpoint written: {'; '.join(parts)}; a scale of 0 breaks every engine "
            "(pass --allow-unobserved to write 1.0 for them)"
        )
    return tuple(sorted(zero + never))
