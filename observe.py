"""Observation: fold K and V, exactly as the KV cache stores them, into running statistics.

Every transformers model with a KV cache hands each layer's new K and V to its cache object's
`update(key, value, layer_idx)`: after k_norm and RoPE, before any GQA repeat, whatever attention
code the model runs (the shared attention interface, its own, a hybrid's attention blocks).
`ObservingCache` is transformers' own `DynamicCache` (built from the model's config, so Mamba,
linear-attention and KV-sharing layers get the cache layers they expect) whose `update` first folds
the tensors into `KVStatistics`. The forward pass is the model's own, unchanged. The statistics
(per layer: amax and a histogram of |x| per KV head) outlive the batch; the cache is dropped after it.

The statistics are plain tensors that reduce by `max` (amax) and `sum` (histogram, token
counts), so partial statistics from several processes or layer groups merge with `merge`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from fp8kv.transformers_cache import cache_kwargs, fold_repeated_heads, model_cache_class, new_cache
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry, LatentCache

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

K, V = 0, 1
Progress = Callable[[int, int], None]
"""Called with (samples done, samples total) after every batch."""


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
    `query`:  float32 [num_layers], max |Q| per layer, only where Q was observed too (fp8kv.api; the driver
              keeps its own).
    An MLA layer (one latent vector per token, one "head") holds that vector's statistics in both K and V.
    """

    amax: torch.Tensor
    hist: torch.Tensor
    tokens: torch.Tensor
    query: torch.Tensor | None = None

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, device: torch.device | str = "cpu") -> KVStatistics:
        return cls(
            amax=torch.zeros(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device),
            hist=torch.zeros(num_layers, 2, num_kv_heads, NUM_BINS, dtype=torch.int64, device=device),
            tokens=torch.zeros(num_layers, dtype=torch.int64, device=device),
        )

    def fold(self, layer: int, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Fold one layer's `key`/`value` [batch, kv_heads, seq, head_dim]; `valid` [batch, seq] marks real tokens.

        A layer with fewer KV heads than the widest layer fills the first `kv_heads` slots; one handing over
        more heads than there are slots (K/V repeated per query head) is folded back to its KV heads.
        """
        slots = self.amax.shape[2]
        if key.shape[1] > slots:
            key, value = (fold_repeated_heads(states, slots, f"layer {layer}") for states in (key, value))
        self.fold_layers([layer], [key], [value], valid)

    def fold_layers(self, layers: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                    valid: torch.Tensor | None) -> None:
        """`fold` of several updates at once (`layers[i]` got `keys[i]`, `values[i]`; a layer may repeat), their K
        (and their V) alike in shape, at most as many heads as there are slots, and all of one forward (`valid`):
        the same integer max and counts in a few large ops rather than many small ones (a decode step hands each
        layer one token per sequence)."""
        slots, heads = self.amax.shape[2], keys[0].shape[1]
        index = torch.tensor(list(layers), device=self.amax.device)
        # [updates * heads]: each update's heads in the flattened [num_layers, 2, slots] statistics, for K
        where = (index[:, None] * 2 * slots + torch.arange(heads, device=index.device)).flatten()
        keep = None if valid is None else valid.to(keys[0].device)[:, None, :, None]  # [batch, 1, seq, 1]
        amax_bits = self.amax.view(torch.int32).view(-1)
        for kind, group in ((K, keys), (V, values)):
            # [batch, updates * heads, seq, head_dim]: the updates' heads side by side, as if one layer had them all
            stacked = torch.stack([states.detach() for states in group], dim=1).flatten(1, 2)
            bits = _magnitude_bits(stacked, keep)
            slot = where + kind * slots
            # |x| orders like its bits (NaN above inf): an integer max, the running amax's bits included, is exact.
            amax_bits.scatter_reduce_(0, slot, bits.amax(dim=(0, 2, 3)).to(amax_bits.device), "amax")
            first_bins = (slot * NUM_BINS).to(device=bits.device, dtype=torch.int32)
            self.hist.view(-1).add_(_histogram(bits, keep, first_bins, self.hist.numel()).to(self.hist.device))
        real = keys[0].shape[0] * keys[0].shape[2] if valid is None else valid.sum().to(index.device)
        self.tokens.index_add_(0, index, torch.ones_like(index) * real)

    @property
    def num_layers(self) -> int:
        return self.amax.shape[0]

    def merge(self, other: KVStatistics) -> None:
        """Fold another partial result in (max of amax, sum of counts)."""
        self.amax = torch.maximum(self.amax, other.amax.to(self.amax.device))
        self.hist += other.hist.to(self.hist.device)
        self.tokens += other.tokens.to(self.tokens.device)
        if other.query is not None:
            theirs = other.query.to(self.amax.device)
            self.query = theirs.clone() if self.query is None else torch.maximum(self.query, theirs)

    def cpu(self) -> KVStatistics:
        query = None if self.query is None else self.query.cpu()
        return KVStatistics(self.amax.cpu(), self.hist.cpu(), self.tokens.cpu(), query)


def _magnitude_bits(states: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """int32 bits of |x| as float32, padding set to 0: [batch, kv_heads, seq, head_dim]."""
    bits = states.to(torch.float32).view(torch.int32) & _ABS_MASK
    return bits if keep is None else bits.masked_fill_(~keep, 0)


def _histogram(bits: torch.Tensor, keep: torch.Tensor | None, first_bins: torch.Tensor, size: int) -> torch.Tensor:
    """Counts of `bits` [batch, heads, seq, head_dim] per bin, head h's NUM_BINS bins from `first_bins[h]` (int32
    [heads]) on: int64 [size]."""
    index = ((bits >> MANTISSA_SHIFT) - _FIRST_BIN_BITS).clamp_(0, NUM_BINS - 1)
    index += first_bins.view(1, -1, 1, 1)
    if keep is not None:
        index.masked_fill_(~keep, size)  # padding goes to one extra bin, dropped below
    return torch.bincount(index.flatten(), minlength=size + 1)[:size]


@dataclass(frozen=True)
class ObservationStep:
    """What the observing cache needs for one forward: where to fold, and which tokens are real.

    `valid`: bool [batch, seq], True for real tokens (None: all real). `layers`: the layers that own
    a cache; others are not folded.
    """

    statistics: KVStatistics
    valid: torch.Tensor | None
    layers: frozenset[int]


SDPA_QUERY_OBSERVER = "fp8kv_observe_query"
EAGER_QUERY_OBSERVER = "fp8kv_observe_query_eager"
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


def _query_observing(attend: Callable[..., Any] | None) -> Callable[..., Any]:
    """An attention function that folds Q into the step's `QueryObservation`, then runs `attend`.

    `attend=None` runs the model file's own `eager_attention_forward` (needed for softcapping).
    """

    def attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
        fold_query(module, query, kwargs)
        inner = attend or sys.modules[type(module).__module__].eager_attention_forward
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def query_observer_for(config: dict[str, Any]) -> str:
    """The attn_implementation that observes Q: eager where SDPA cannot run the model (logit softcapping)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(SDPA_QUERY_OBSERVER, _query_observing(sdpa_attention_forward))
    AttentionMaskInterface.register(SDPA_QUERY_OBSERVER, sdpa_mask)
    AttentionInterface.register(EAGER_QUERY_OBSERVER, _query_observing(None))
    AttentionMaskInterface.register(EAGER_QUERY_OBSERVER, eager_mask)
    text = config.get("text_config") or config
    return EAGER_QUERY_OBSERVER if text.get("attn_logit_softcapping") is not None else SDPA_QUERY_OBSERVER


def observing_cache(model: torch.nn.Module, step: ObservationStep):
    """A fresh cache for `model` whose `update` folds each cache-owning layer's K/V into `step`.

    transformers' `DynamicCache` built from the model's config, or the cache class the model's file
    defines for itself (MiniMax), which its forward insists on.
    """
    base = model_cache_class(model)
    latent = LatentCache.from_config(model.config.get_text_config(decoder=True), f"{type(model).__name__}'s config")

    class ObservingCache(base):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            fold_update(step, latent, layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return new_cache(ObservingCache, model)


def fold_update(step: ObservationStep, latent: LatentCache | None, layer_idx: int, key_states: torch.Tensor,
                value_states: torch.Tensor) -> None:
    """Fold what one cache `update(key_states, value_states, layer_idx)` receives into `step` (the one observer:
    the driver's cache and fp8kv.api's live observation both call it)."""
    if layer_idx in step.layers and latent is not None:
        fold_latent(step, layer_idx, key_states, value_states, latent)
    elif layer_idx in step.layers:
        step.statistics.fold(layer_idx, key_states, value_states, step.valid)
    elif layer_idx >= step.statistics.num_layers:
        raise Fp8kvError(
            f"the forward cached K/V under cache layer {layer_idx}, past the config's "
            f"{step.statistics.num_layers} layers (a layer run more than once per token, each run with its "
            "own cache); a checkpoint has one scale per layer, so fp8kv cannot scale it"
        )


def fold_latent(step: ObservationStep, layer: int, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                latent: LatentCache) -> None:
    """Multi-head latent attention: fold what the latent cache stores, `concat(kv_c_normed, k_pe)`.

    transformers' MLA attention hands its cache the latent after `kv_a_layernorm` as the key
    `[batch, 1, seq, kv_lora_rank]` and the rope key after RoPE as the value `[batch, 1, seq, rope]`.
    vLLM quantizes their concatenation with the layer's one k_scale, so the vector is folded into
    both the K and the V slot: the one scale of the layer then comes out as its K and its V scale.
    """
    expected = (1, latent.kv_lora_rank), (1, latent.qk_rope_head_dim)
    if ((kv_c_normed.shape[1], kv_c_normed.shape[-1]), (k_pe.shape[1], k_pe.shape[-1])) != expected:
        raise Fp8kvError(
            f"layer {layer}: the MLA cache update got key {list(kv_c_normed.shape)} and value {list(k_pe.shape)}, "
            f"not the latent [.., 1, .., {latent.kv_lora_rank}] and rope key [.., 1, .., {latent.qk_rope_head_dim}] "
            "vLLM caches; this transformers version caches something else"
        )
    vector = torch.cat([kv_c_normed, k_pe.to(kv_c_normed.dtype)], dim=-1)  # [batch, 1, seq, width]
    step.statistics.fold(layer, vector, vector, step.valid)


def observe_batch(
    base_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    statistics: KVStatistics,
    layers: frozenset[int],
    query: torch.Tensor | None = None,
) -> None:
    """Run the base model (no LM head) over one right-padded batch, folding K/V of `layers`.

    `input_ids`, `attention_mask`: [batch, seq] on the model's device. `query` (float32 [num_layers]),
    when given, also folds max |Q| per layer; the model must then have been loaded with
    `attn_implementation=query_observer_for(config)`.
    """
    valid = attention_mask.bool()
    step = ObservationStep(statistics, None if bool(valid.all()) else valid, layers)
    cache = observing_cache(base_model, step)
    extra = {} if query is None else {QUERY_KWARG: QueryObservation(query, step.valid)}
    try:
        base_model(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(base_model, cache), **extra)
    except Fp8kvError:
        raise
    except Exception as exc:
        own = _own_forward_failure(base_model, input_ids, attention_mask)
        if own is None:  # transformers runs it: the failure is fp8kv's
            raise
        raise own from exc


def _own_forward_failure(base_model: torch.nn.Module, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor) -> Fp8kvError | None:
    """After the observed forward raised: the error saying that transformers' own forward (its own cache,
    nothing of fp8kv's) fails on the same batch too, else None."""
    try:
        base_model(input_ids=input_ids, attention_mask=attention_mask)
    except Exception as own:  # whatever the model's code raises is the checkpoint's problem, reported as is
        message = " ".join(str(own).split())[:300]
        return Fp8kvError(f"{base_model.name_or_path}: transformers' own {type(base_model).__name__} forward fails on "
                          f"this checkpoint ({type(own).__name__}: {message}); fp8kv calibrates and verifies only "
                          "models transformers runs")
    return None


def observe(
    model: torch.nn.Module,
    batches: Sequence[Any],
    geometry: AttentionGeometry,
    progress: Progress | None = None,
    query: torch.Tensor | None = None,
    last_batch: KVStatistics | None = None,
) -> KVStatistics:
    """Run `model`'s base model over `batches` (`fp8kv.data.Batch`) and return the folded K/V statistics (CPU).

    `geometry` names the layers and heads. `query` (float32 [num_layers], CPU),
    when given, receives max |Q| per layer (load the model with `query_observer_for`). With `last_batch`,
    the final batch is also folded into it alone (for `--strategy last-batch`).
    """
    device = next(model.parameters()).device
    total = sum(batch.input_ids.shape[0] for batch in batches)
    statistics = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, device)
    layers = frozenset(geometry.kv_layers)
    query_on_device = None if query is None else query.to(device)
    done = 0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            if last_batch is not None and index == len(batches) - 1:
                alone = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, device)
                observe_batch(model.base_model, ids, mask, alone, layers, query_on_device)
                statistics.merge(alone)
                last_batch.merge(alone.cpu())
            else:
                observe_batch(model.base_model, ids, mask, statistics, layers, query_on_device)
            done += ids.shape[0]
            if progress is not None:
                progress(done, total)
    if query is not None:
        query.copy_(query_on_device.cpu())
    return statistics.cpu()
