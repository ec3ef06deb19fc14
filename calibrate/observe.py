"""Observation: fold K and V, exactly as the KV cache stores them, into running statistics.

A function registered with transformers' `AttentionInterface` sees every attention layer's
`key`/`value` after k_norm and RoPE and before any GQA repeat — the tensors a cache stores.
It folds them into `KVStatistics` and then runs the model's own attention, so the forward
pass is unchanged. Only statistics are kept (per layer: amax and a histogram of |x| per KV
head), never K or V: memory is O(layers).

The statistics are plain tensors that reduce by `max` (amax) and `sum` (histogram, token
counts), so partial statistics from several processes or layer groups merge with `merge`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Histogram of |x| with fixed bins read straight from the float32 bits: 32 bins per octave
# (the exponent and the top 5 mantissa bits), octaves 2**LOG2_LOW .. 2**LOG2_HIGH. Bin 0 also
# holds everything smaller (zeros), the last bin everything larger (and inf/NaN).
BINS_PER_OCTAVE = 32
MANTISSA_SHIFT = 23 - 5  # float32 has 23 mantissa bits; keep the top 5
LOG2_LOW = -24
LOG2_HIGH = 24
NUM_BINS = (LOG2_HIGH - LOG2_LOW) * BINS_PER_OCTAVE
_FIRST_BIN_BITS = (127 + LOG2_LOW) * BINS_PER_OCTAVE  # (biased exponent, mantissa top bits) of bin 0
_ABS_MASK = 0x7FFFFFFF

OBSERVE_KWARG = "fp8kv_observation"
"""The forward keyword that carries an `ObservationStep` down to the attention function."""

SDPA_OBSERVER = "fp8kv_observe"
EAGER_OBSERVER = "fp8kv_observe_eager"
K, V = 0, 1


def bin_edges() -> torch.Tensor:
    """The NUM_BINS + 1 bin edges of the |x| histogram, float64. Edge 0 stands for 0."""
    i = torch.arange(NUM_BINS + 1, dtype=torch.float64)
    octave, step = torch.div(i, BINS_PER_OCTAVE, rounding_mode="floor"), i % BINS_PER_OCTAVE
    edges = torch.exp2(LOG2_LOW + octave) * (1 + step / BINS_PER_OCTAVE)
    edges[0] = 0.0
    return edges


@dataclass
class KVStatistics:
    """Running statistics of the cached K and V of every layer.

    `amax`:   float32 [num_layers, 2, num_kv_heads], max |x| per layer, K/V, KV head (0 = K, 1 = V).
    `hist`:   int64 [num_layers, 2, num_kv_heads, NUM_BINS], counts of |x| per log-spaced bin.
    `tokens`: int64 [num_layers], real (non-padding) tokens folded per layer.
    """

    amax: torch.Tensor
    hist: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, device: torch.device | str = "cpu") -> KVStatistics:
        return cls(
            amax=torch.zeros(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device),
            hist=torch.zeros(num_layers, 2, num_kv_heads, NUM_BINS, dtype=torch.int64, device=device),
            tokens=torch.zeros(num_layers, dtype=torch.int64, device=device),
        )

    def fold(self, layer: int, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Fold one layer's `key`/`value` [batch, kv_heads, seq, head_dim]; `valid` [batch, seq] marks real tokens."""
        keep = None if valid is None else valid.to(key.device)[:, None, :, None]  # [batch, 1, seq, 1]
        for kind, states in ((K, key), (V, value)):
            bits = _magnitude_bits(states.detach(), keep)
            # |x| orders like its bits (NaN above inf), so an integer max is the exact amax and keeps NaN.
            amax = bits.amax(dim=(0, 2, 3)).view(torch.float32)
            self.amax[layer, kind] = torch.maximum(self.amax[layer, kind], amax)
            self.hist[layer, kind] += _histogram(bits, keep)
        self.tokens[layer] += key.shape[0] * key.shape[2] if valid is None else valid.sum().to(self.tokens.device)

    def merge(self, other: KVStatistics) -> None:
        """Fold another partial result in (max of amax, sum of counts)."""
        self.amax = torch.maximum(self.amax, other.amax.to(self.amax.device))
        self.hist += other.hist.to(self.hist.device)
        self.tokens += other.tokens.to(self.tokens.device)

    def cpu(self) -> KVStatistics:
        return KVStatistics(self.amax.cpu(), self.hist.cpu(), self.tokens.cpu())


def _magnitude_bits(states: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """int32 bits of |x| as float32, padding set to 0: [batch, kv_heads, seq, head_dim]."""
    bits = states.to(torch.float32).view(torch.int32) & _ABS_MASK
    return bits if keep is None else bits.masked_fill_(~keep, 0)


def _histogram(bits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Counts per KV head and bin of `bits` [batch, kv_heads, seq, head_dim]: int64 [kv_heads, NUM_BINS]."""
    heads = bits.shape[1]
    index = ((bits >> MANTISSA_SHIFT) - _FIRST_BIN_BITS).clamp_(0, NUM_BINS - 1)
    index += torch.arange(heads, device=bits.device, dtype=index.dtype).view(1, heads, 1, 1) * NUM_BINS
    if keep is not None:
        index.masked_fill_(~keep, heads * NUM_BINS)  # padding goes to one extra bin, dropped below
    counts = torch.bincount(index.flatten(), minlength=heads * NUM_BINS + 1)
    return counts[: heads * NUM_BINS].view(heads, NUM_BINS)


@dataclass(frozen=True)
class ObservationStep:
    """What the attention function needs for one forward: where to fold, and which tokens are real.

    `valid`: bool [batch, seq], True for real tokens (None: all real). `layers`: the layers that own
    a cache; others (KV-sharing layers) are not folded.
    """

    statistics: KVStatistics
    valid: torch.Tensor | None
    layers: frozenset[int]


QUERY_KWARG = "fp8kv_query_observation"
"""The forward keyword that carries a `QueryObservation` (only when query scales are calibrated)."""


@dataclass(frozen=True)
class QueryObservation:
    """Running max |Q| per layer, float32 [num_layers], and which tokens are real (bool [batch, seq] or None).

    Q is taken as the attention function receives it, which is what an fp8 attention kernel
    quantizes: after q_norm and RoPE, before the softmax scale (the kernel reads `fp8(q / q_scale)`
    and multiplies `q_scale` back into the scores).
    """

    amax: torch.Tensor
    valid: torch.Tensor | None


def fold_query(module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Fold `query` [batch, heads, seq, head_dim] into the step's `QueryObservation`, if it carries one."""
    observation: QueryObservation | None = kwargs.pop(QUERY_KWARG, None)
    if observation is None:
        return
    magnitude = query.detach().float().abs()
    if observation.valid is not None:
        magnitude = magnitude.masked_fill(~observation.valid.to(query.device)[:, None, :, None], 0.0)
    layer = module.layer_idx
    observation.amax[layer] = torch.maximum(observation.amax[layer], magnitude.amax().to(observation.amax.device))


def _observing(attend: Callable[..., Any] | None) -> Callable[..., Any]:
    """An attention function that folds K/V into the step's statistics, then runs `attend`.

    `attend=None` runs the model file's own `eager_attention_forward` (needed for softcapping).
    """

    def attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
        step: ObservationStep | None = kwargs.pop(OBSERVE_KWARG, None)
        fold_query(module, query, kwargs)
        if step is not None and module.layer_idx in step.layers:
            step.statistics.fold(module.layer_idx, key, value, step.valid)
        inner = attend or sys.modules[type(module).__module__].eager_attention_forward
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def register_observers() -> None:
    """Register the observing attention functions (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(SDPA_OBSERVER, _observing(sdpa_attention_forward))
    AttentionMaskInterface.register(SDPA_OBSERVER, sdpa_mask)
    AttentionInterface.register(EAGER_OBSERVER, _observing(None))
    AttentionMaskInterface.register(EAGER_OBSERVER, eager_mask)


def observer_for(config: dict[str, Any]) -> str:
    """The attn_implementation to load a model with: eager where SDPA cannot run it (logit softcapping)."""
    register_observers()
    text = config.get("text_config") or config
    return EAGER_OBSERVER if text.get("attn_logit_softcapping") is not None else SDPA_OBSERVER


def observe_batch(
    base_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    statistics: KVStatistics,
    layers: frozenset[int],
    query: torch.Tensor | None = None,
) -> None:
    """Run the base model (no LM head) over one right-padded batch, folding K/V of `layers`.

    `input_ids`, `attention_mask`: [batch, seq] on the model's device; the model must have been
    loaded with `attn_implementation=observer_for(config)`. `query` (float32 [num_layers]), when
    given, also folds max |Q| per layer.
    """
    valid = attention_mask.bool()
    step = ObservationStep(statistics, None if bool(valid.all()) else valid, layers)
    extra = {} if query is None else {QUERY_KWARG: QueryObservation(query, step.valid)}
    base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **{OBSERVE_KWARG: step}, **extra)
