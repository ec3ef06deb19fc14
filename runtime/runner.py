"""Run a Hugging Face causal LM on the paged KV cache, through transformers' AttentionInterface.

The model's own code computes Q/K/V (after q/k norms and RoPE); `_paged_attention` writes K/V into
the paged cache and attends over it. Tokens of all sequences in a step are flattened into one
batch row with explicit position ids, as vLLM does, so prefill and decode mix freely. Models that
compute attention in their own code, and hybrids with a recurrent state, run one sequence per forward
on a cache view of the same pages (`runtime.cache_view`).

    runner = PagedModelRunner("path/to/model", cache_dtype="fp8_e4m3", k_scales=ks, v_scales=vs)
    a, _ = runner.start()
    logits = runner.step([(a, prompt_ids)])[0]                 # [len(prompt_ids), vocab]
    b, reused = runner.start(share_from=a, shared_tokens=len(prefix))
    logits_b = runner.step([(b, other_ids[reused:])])[0]       # reads a's prefix pages
"""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8kv.checkpoint.load import MODEL_DTYPES, load_language_model
from fp8kv.errors import Fp8kvError
from fp8kv.engine_models import DEFAULT_ENGINE, EngineModel, as_engine_model
from fp8kv.fp8 import cache_dtype as _cache_dtype
from fp8kv.fp8 import FP8_DTYPES, canonical_cache_dtype, quantize, to_float32, to_fp8
from fp8kv.geometry import AttentionGeometry
from fp8kv.kvdtypes import NVFP4_WRITES
from fp8kv.options import DEFAULT_KV_DTYPE, FOUR_OVER_SIX_WRITE, FP8_K_NVFP4_V
from fp8kv.runtime.attention import NUMERICS, AttentionNumerics, kernel_supported, ragged_paged_attention
from fp8kv.runtime.cache import SCRATCH_PAGE, CacheCounts, ForwardCounts, PageAllocator, PagedKVCache, Scale
from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache
from fp8kv.runtime.cache_view import sequence_cache
from fp8kv.transformers_cache import cache_kwargs, model_cache_class, new_cache, recurrent_layers
from fp8kv.runtime.device import RuntimeDevice, resolve_device, tpu_version
from fp8kv.runtime.latent import LatentPagedCache, capture_latents, latent_attention
from fp8kv.runtime.linear import sum_linears_in_float32

ATTN_IMPLEMENTATION = "fp8kv_paged"
# The step the attention function runs, bound by `PagedModelRunner.step` for one forward. Not a forward
# keyword argument: some decoder layers call their attention without passing the model's keyword
# arguments on (stablelm), while every attention module reaches the registered function.
_ACTIVE_STEP: contextvars.ContextVar[PagedStep] = contextvars.ContextVar("fp8kv_paged_step")


@dataclass(frozen=True)
class StepMetadata:
    """Where one step's tokens go in the cache and what each sequence attends to (device tensors)."""

    slot_mapping: torch.Tensor  # int64 [T] flat cache slot of each token (padding -> scratch page)
    valid: torch.Tensor  # bool [T] real tokens (padding is not counted in overflow statistics)
    kv_lens: torch.Tensor  # int32 [S] cached tokens per sequence after this step
    page_indices: torch.Tensor  # int32 [S, pages_per_seq]
    cu_q_lens: torch.Tensor  # int32 [S + 1] start of each sequence's tokens in the flat batch
    num_seqs: torch.Tensor  # int32 [1]
    max_q_len: int | None  # static bound on new tokens per sequence (None: exact, non-XLA only)


@dataclass(frozen=True)
class SequenceWrites:
    """What one step's cache writes held for one sequence: values past the fp8 maximum, and per shadow engine
    (by name) the values that engine would have stored differently (0: it writes this cache's bytes)."""

    over: int
    shadow_diffs: dict[str, int]


@dataclass(frozen=True)
class PagedStep:
    """What the attention function needs for one forward: the cache, the metadata, the backend."""

    cache: PagedKVCache
    meta: StepMetadata
    backend: str
    use_kernel: bool
    numerics: AttentionNumerics  # the torch backend's arithmetic (runtime.attention)
    calls: Counter[str]  # the runner's count of attention calls, by the function that ran
    q_scales: dict[int, torch.Tensor] | None = None  # fp8 attention: the query is read as fp8(q / q_scale)


def _paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, q_heads, T, d]`, key/value `[1, kv_heads, T, d]`."""
    step = _ACTIVE_STEP.get(None)
    if step is None:
        raise Fp8kvError(f"{ATTN_IMPLEMENTATION} attention runs only inside PagedModelRunner.step")
    if isinstance(step.cache, LatentPagedCache):
        return latent_attention(module, query, key, step.cache, step.meta, scaling, step.calls), None
    meta, layer = step.meta, step.cache.owner(module.layer_idx)
    tiles, restore = key.shape[1] // step.cache.layer_kv_heads(layer), None
    if tiles > 1:  # JetMoe hands K/V tiled once per chosen expert (repeat, not repeat_interleave): cache one tile
        kv_heads = key.shape[1] // tiles
        key, value = key[:, :kv_heads], value[:, :kv_heads]
        # query head i reads tiled head i // group, i.e. cache head (i // group) % kv_heads; the paged attention
        # reads cache head i // (tiles * group): order the query heads by cache head, and the output back
        group = query.shape[1] // (tiles * kv_heads)
        order = torch.arange(query.shape[1], device=query.device).view(tiles, kv_heads, group).transpose(0, 1)
        query, restore = query[:, order.flatten()], torch.argsort(order.flatten())
    v_dim = value.shape[-1]
    if v_dim > key.shape[-1]:
        raise Fp8kvError(f"layer {module.layer_idx}: V head_dim {v_dim} wider than K's {key.shape[-1]} is not supported")
    if v_dim < key.shape[-1]:  # V narrower than K (mimo_v2_flash): zero columns in the cache, cut from the output
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))
    if layer == module.layer_idx:  # a KV-sharing layer reads K/V its owner wrote in this forward
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, d]
        step.cache.write(layer, k, v, meta.slot_mapping, meta.valid)
    k_scale, v_scale = step.cache.scale_args(layer)
    q = query[0].transpose(0, 1)  # [T, q_heads, d]
    if step.q_scales is not None:  # what an fp8 attention kernel computes with: fp8(q / q_scale) * q_scale
        fp8_q = quantize(q, step.q_scales[layer], FP8_DTYPES[DEFAULT_KV_DTYPE])
        q = (to_float32(fp8_q) * step.q_scales[layer]).to(q.dtype)
    out = ragged_paged_attention(
        q,
        step.cache.layer_pages(layer),
        meta.kv_lens,
        meta.page_indices,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
        soft_cap=softcap,
        backend=step.backend,
        max_q_len=meta.max_q_len,
        use_kernel=step.use_kernel,
        sinks=kwargs.get("s_aux"),
        chunk_size=_chunk_size(module),
        numerics=step.numerics,
        calls=step.calls,
    )
    if step.cache.fp8_attention_output:
        out = to_fp8(out, FP8_DTYPES[DEFAULT_KV_DTYPE], saturate=True).to(out.dtype)
    out = out if restore is None else out[:, restore]
    out = out if v_dim == out.shape[-1] else out[..., :v_dim]
    return out.unsqueeze(0), None  # [1, T, q_heads, v_dim]


def _chunk_size(module: torch.nn.Module) -> int | None:
    """llama4's chunked layers attend within chunks of `attention_chunk_size` positions."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None) or []
    chunked = module.layer_idx < len(layer_types) and layer_types[module.layer_idx] == "chunked_attention"
    return config.attention_chunk_size if chunked else None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)


class PagedModelRunner:
    """A Hugging Face causal LM running on a paged (optionally fp8) KV cache.

    Args:
        model_dir: a local checkpoint folder.
        device: "auto", "tpu", "xla-cpu", "cuda" or "cpu".
        cache_dtype: "fp8_e4m3" (or vLLM's "fp8"), "fp8_e5m2", "bf16" or "fp32"; or vLLM's NVFP4 writes,
            "nvfp4" and "nvfp4_4over6", or "fp8_k_nvfp4_v" (K written as this runner's fp8 e4m3 cache writes it, V as
            "nvfp4"; `runtime.nvfp4_cache`), read back as `nvfp4_read` says ("float32", or "fp8": sm100's attention
            in fp8, with `q_scales` for the query).
        k_scales, v_scales: {kv layer index: float or per-KV-head list}; None = 1.0 (fp8 only).
        engine: the engine model the cache reproduces (`fp8kv.engine_models`): its fp8 write, the scales it
            runs with and the fp8 format it allocates; the default is vLLM TPU's (divide in float32, clamp).
        shadow_engines: engine models the cache also computes every write for, counting per token the values
            each would store differently (`sequence_writes`; none: that engine's logits are this runner's).
        page_size, max_model_len, max_num_seqs: cache geometry; `num_pages` defaults to enough
            pages for `max_num_seqs` sequences of `max_model_len` tokens (plus the scratch page).
        dtype: model weights dtype (default: the checkpoint's).
        attention_backend: "auto" (torch_xla's ragged_paged_attention on XLA devices: the Pallas
            kernel on a TPU it supports, torch_xla's reference elsewhere; vectorized torch on CPU and
            CUDA), "torch" (vectorized torch everywhere; static shapes on XLA) or "xla".
        model: weights from `load_model` to share between runners (each runner owns only its cache);
            None loads them from `model_dir`.
        q_scales: {kv layer index: float}: quantize the query to fp8 e4m3 with these scales before
            attention, as fp8 attention kernels do (None: the query stays in the model dtype).
        attention_numerics: the arithmetic of the torch backend (`runtime.attention.AttentionNumerics`):
            "float32" (default), or torch_xla's "xla-reference" or "pallas-kernel" rounding reproduced. On the
            "xla" backend torch_xla's function has its own, and only that one may be asked for. A model that does
            not attend through the ragged paged attention (`runs_ragged_attention`) takes none: its logits come
            from its own arithmetic (`arithmetic`).

    A multi-head latent attention model (`geometry.latent`) runs on a `LatentPagedCache` instead: one
    latent vector per token, quantized with k_scale, expanded through `kv_b_proj` when attending.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        cache_dtype: str = "bf16",
        k_scales: Mapping[int, Scale] | None = None,
        v_scales: Mapping[int, Scale] | None = None,
        engine: str | EngineModel = DEFAULT_ENGINE,
        shadow_engines: Sequence[str | EngineModel] = (),
        page_size: int = 16,
        max_model_len: int = 512,
        max_num_seqs: int = 8,
        num_pages: int | None = None,
        dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
        model: torch.nn.Module | None = None,
        q_scales: Mapping[int, float] | None = None,
        attention_numerics: AttentionNumerics | None = None,
        nvfp4_read: str = "float32",
    ) -> None:
        self.runtime_device: RuntimeDevice = resolve_device(device)
        self.geometry = AttentionGeometry.from_dir(model_dir)
        self.model = model if model is not None else load_model(model_dir, self.runtime_device.device, dtype)
        # a model with its own attention code, or a hybrid, was loaded with its own attention: it reads the
        # pages through a cache view, one sequence per forward; a hybrid keeps each sequence's recurrent state
        self.cache_view = self.model.config._attn_implementation != ATTN_IMPLEMENTATION
        self.recurrent = recurrent_layers(self.geometry.layer_types)
        if any(hasattr(module, "_setup_cache") for module in self.model.modules()):
            # its recurrent state lives in the modules, shared by every sequence, not in a cache per sequence
            raise Fp8kvError(f"{self.geometry.model_type} keeps its recurrent state inside its modules "
                             "(_setup_cache), not in a cache per sequence: the paged runtime cannot run "
                             "sequences side by side")
        self._states: dict[int, object] = {}
        self.position_offset = _position_offset(self.model)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.backend = _resolve_backend(attention_backend, self.runtime_device)
        g = self.geometry
        nvfp4 = cache_dtype in (*NVFP4_WRITES, FP8_K_NVFP4_V)
        if nvfp4 and (g.latent is not None or shadow_engines):
            raise Fp8kvError("an NVFP4 cache is modelled for K/V attention without shadow engines, not for "
                             "multi-head latent attention (MLA) or shadow engines' fp8 writes")
        if nvfp4:
            self.cache: PagedKVCache | LatentPagedCache = Nvfp4PagedKVCache(
                g.kv_layers, num_pages=num_pages or max_num_seqs * self.pages_per_seq + 1, page_size=page_size,
                num_kv_heads=[g.layer_kv_heads(layer) for layer in g.kv_layers],
                head_dim=[g.layer_head_dim(layer) for layer in g.kv_layers], device=self.runtime_device.device,
                four_over_six=cache_dtype == FOUR_OVER_SIX_WRITE, fp8_keys=cache_dtype == FP8_K_NVFP4_V, read=nvfp4_read,
                head_dim_multiple=self.runtime_device.head_dim_multiple,
                k_scales=k_scales, v_scales=v_scales, engine=engine, shared_layers=dict(g.shared_kv_sources))
        elif g.latent is not None:
            dtype_of_cache = _cache_dtype(as_engine_model(engine).cache_dtype(canonical_cache_dtype(cache_dtype)))
            if q_scales is not None:
                raise Fp8kvError("q_scales: fp8 attention is not modelled for multi-head latent attention (MLA)")
            self.cache = LatentPagedCache(
                g.kv_layers, latent=g.latent, num_pages=num_pages or max_num_seqs * self.pages_per_seq + 1,
                page_size=page_size, dtype=dtype_of_cache, device=self.runtime_device.device,
                k_scales=k_scales, v_scales=v_scales, engine=engine, shadows=shadow_engines)
            capture_latents(self.model)
        else:
            dtype_of_cache = _cache_dtype(as_engine_model(engine).cache_dtype(canonical_cache_dtype(cache_dtype)))
            self.cache = PagedKVCache(
                g.kv_layers,
                num_pages=num_pages or max_num_seqs * self.pages_per_seq + 1,
                page_size=page_size,
                num_kv_heads=[g.layer_kv_heads(layer) for layer in g.kv_layers],
                head_dim=[g.layer_head_dim(layer) for layer in g.kv_layers],
                dtype=dtype_of_cache,
                device=self.runtime_device.device,
                head_dim_multiple=self.runtime_device.head_dim_multiple,
                k_scales=k_scales,
                v_scales=v_scales,
                engine=engine,
                shared_layers=dict(g.shared_kv_sources),
                shadows=shadow_engines,
            )
        # The Pallas kernel where vLLM's TPU backend would run it; torch_xla's reference elsewhere.
        self.use_kernel = (self.backend == "xla" and self.runtime_device.kind == "tpu" and g.latent is None and all(
            kernel_supported(tpu_version(), g.layer_kv_heads(layer), self.cache.dtype) for layer in g.kv_layers))
        self.runs_ragged = runs_ragged_attention(self.model, g)
        if attention_numerics is not None and not self.runs_ragged:
            raise Fp8kvError(f"attention numerics {attention_numerics!r}: {g.model_type} attends in its own code or "
                             "over MLA latents, in the model's dtype; only the ragged paged attention reproduces "
                             "another arithmetic")
        self.numerics = _resolve_numerics(attention_numerics, self.backend, self.use_kernel)
        self.allocator = PageAllocator(self.cache.num_pages, page_size)
        if q_scales is not None and self.cache_view:
            raise Fp8kvError(f"{g.model_type} runs its own attention on a cache view: its query cannot be quantized")
        if q_scales is not None and sorted(q_scales) != sorted(g.kv_layers):
            raise Fp8kvError(f"q_scales cover layers {sorted(q_scales)}; give one per KV layer {list(g.kv_layers)}")
        self.q_scales = None if q_scales is None else {
            layer: torch.tensor(float(q_scales[layer]), device=self.device) for layer in g.kv_layers}
        self.calls: Counter[str] = Counter()
        self._forwards: list[tuple[ForwardCounts, list[int]]] = []  # the last step's, with each sequence's token bounds
        self._next_id = 0
        self._sync()  # materialize the zeroed caches, so the first step compiles the same graph as later ones

    @property
    def arithmetic(self) -> str:
        """The attention arithmetic the logits come from: `numerics` where the ragged paged attention attends;
        the model's dtype where the model attends in its own code over a cache view, or over MLA latents (both
        read the K/V dequantized into that dtype)."""
        return self.numerics if self.runs_ragged else str(self.model.dtype).removeprefix("torch.")

    @property
    def attention(self) -> str:
        """The attention that ran, from counted calls (`calls`): its name, names joined by " + ", or "none"."""
        return " + ".join(sorted(self.calls)) or "none"

    @property
    def device(self) -> torch.device:
        return self.runtime_device.device

    def start(self, share_from: int | None = None, shared_tokens: int = 0) -> tuple[int, int]:
        """Open a sequence; returns `(seq_id, reused)`.

        With `share_from`, the new sequence reuses the cache pages of that sequence's first
        `shared_tokens` tokens (whole pages only): feed it its tokens from index `reused` on. A hybrid
        reuses nothing: the recurrent state at the end of a shared prefix is not kept.
        """
        if share_from is not None and share_from not in self.allocator.tables:
            raise Fp8kvError(f"cannot share the prefix of sequence {share_from}: it does not exist")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        if self.recurrent:
            self._states[seq_id] = new_cache(model_cache_class(self.model), self.model)
            return seq_id, self.allocator.add(seq_id)
        return seq_id, self.allocator.add(seq_id, share_from, shared_tokens)

    def free(self, seq_id: int) -> None:
        """Close a sequence and release its pages (and a hybrid's recurrent state)."""
        self.allocator.free(seq_id)
        self._states.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        """Tokens of `seq_id` in the cache."""
        return self.allocator.lengths[seq_id]

    @torch.no_grad()  # not inference_mode: torch_xla 2.9 cannot set version counters of inference tensors
    def step(self, batch: Sequence[tuple[int, Sequence[int]]],
             logits_dtype: torch.dtype | None = torch.float32) -> list[torch.Tensor]:
        """Append tokens to sequences and run the model once over all of them.

        `batch` lists `(seq_id, new_token_ids)`; a prompt (prefill), one token (decode) or a chunk
        may be mixed freely. Returns CPU logits `[len(new_token_ids), vocab]` per entry, in `logits_dtype`
        (None: the model's own, for a caller that converts a few rows at a time: a prefill's float32 logits on a
        262k vocabulary are 2 GB, whose conversion alone took 0.5 to 0.7 s).
        """
        self._check_batch(batch)
        self._forwards = []
        if self.cache_view:
            return [self._cache_view_step(seq_id, tokens, logits_dtype) for seq_id, tokens in batch]
        ids, positions, meta = self._prepare(batch)
        step = PagedStep(self.cache, meta, self.backend, self.use_kernel, self.numerics, self.calls, self.q_scales)
        counts = self.cache.start_forward(ids.shape[1])
        bound = _ACTIVE_STEP.set(step)
        try:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        finally:
            _ACTIVE_STEP.reset(bound)
        self._sync()  # cut the graph here: cache writes and logits of this step, one compile per shape
        logits = logits[0].to(logits_dtype or logits.dtype).cpu()
        bounds = meta.cu_q_lens.cpu().tolist()[: len(batch) + 1]
        self._forwards.append((counts, bounds))
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(batch))]

    def sequence_writes(self) -> list[SequenceWrites]:
        """What the last step wrote for each of its sequences, in its order (read from the device here)."""
        writes = []
        for counts, bounds in self._forwards:
            over, diffs = counts.over.cpu().tolist(), counts.shadow_diffs.cpu().tolist()
            for start, end in zip(bounds, bounds[1:]):
                writes.append(SequenceWrites(sum(over[start:end]), {shadow.name: sum(row[start:end])
                                                                    for shadow, row in zip(self.cache.shadows, diffs)}))
        return writes

    def _cache_view_step(self, seq_id: int, tokens: Sequence[int], logits_dtype: torch.dtype | None) -> torch.Tensor:
        """One sequence's forward on a cache view of its pages: CPU logits `[len(tokens), vocab]`."""

        past, dev = self.length(seq_id), self.device
        slots = torch.tensor(self.allocator.extend(seq_id, len(tokens)), dtype=torch.int64).to(dev)
        attention = [i for i in range(self.geometry.num_layers) if i not in self.recurrent]
        cache = sequence_cache(self.cache, attention, past, slots, self.allocator.tables[seq_id], self.calls,
                               self._states.get(seq_id))
        ids = torch.tensor([list(tokens)]).to(dev)
        positions = torch.arange(past, past + len(tokens))[None].to(dev) + self.position_offset
        self._forwards.append((self.cache.start_forward(len(tokens)), [0, len(tokens)]))
        logits = self.model(input_ids=ids, position_ids=positions, **cache_kwargs(self.model, cache)).logits
        self._sync()
        return logits[0].to(logits_dtype or logits.dtype).cpu()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding of each prompt (batched prefill, then batched decode); frees its sequences."""
        seqs = [self.start()[0] for _ in prompts]
        logits = self.step(list(zip(seqs, prompts)))
        tokens = [[int(row[-1].argmax())] for row in logits]
        for _ in range(max_new_tokens - 1):
            logits = self.step([(s, out[-1:]) for s, out in zip(seqs, tokens)])
            for out, row in zip(tokens, logits):
                out.append(int(row[-1].argmax()))
        for s in seqs:
            self.free(s)
        return tokens

    def counts(self) -> CacheCounts:
        """The cache's counters per KV layer: values clamped, NaN/inf values stored, values written."""
        return self.cache.counts()

    def _sync(self) -> None:
        if self.runtime_device.is_xla:
            import torch_xla

            torch_xla.sync()

    def _check_batch(self, batch: Sequence[tuple[int, Sequence[int]]]) -> None:
        if not batch or len(batch) > self.max_num_seqs:
            raise Fp8kvError(f"a step takes 1 to max_num_seqs={self.max_num_seqs} sequences, got {len(batch)}")
        for seq_id, tokens in batch:
            if seq_id not in self.allocator.tables:
                raise Fp8kvError(f"sequence {seq_id} was not started (call start() first)")
            if not tokens:
                raise Fp8kvError(f"sequence {seq_id}: a step needs at least one new token")
            if self.recurrent and self.length(seq_id) and len(tokens) > 1:  # Mamba mixers continue token by token
                raise Fp8kvError(f"sequence {seq_id}: a hybrid continues a started sequence one token per step "
                                 f"(its recurrent layers), got {len(tokens)}")
            if self.length(seq_id) + len(tokens) > self.max_model_len:
                raise Fp8kvError(
                    f"sequence {seq_id}: {self.length(seq_id) + len(tokens)} tokens exceed "
                    f"max_model_len={self.max_model_len}; raise --max-model-len"
                )

    def _prepare(self, batch: Sequence[tuple[int, Sequence[int]]]):
        """Flatten the batch into `input_ids`/`position_ids` `[1, T]` and the step's metadata."""
        ids, positions, slots, kv_lens, tables, cu = [], [], [], [], [], [0]
        for seq_id, tokens in batch:
            start = self.length(seq_id)
            slots += self.allocator.extend(seq_id, len(tokens))
            ids += list(tokens)
            positions += range(start + self.position_offset, start + self.position_offset + len(tokens))
            kv_lens.append(start + len(tokens))
            tables.append(self.allocator.tables[seq_id])
            cu.append(cu[-1] + len(tokens))
        real = len(ids)
        xla = self.runtime_device.is_xla
        # XLA compiles one graph per shape: pad tokens to a power of two and sequences/pages to the maximum
        total = _bucket(real) if xla else real
        num_slots = self.max_num_seqs if xla else len(batch)
        width = self.pages_per_seq if xla else max(len(t) for t in tables)
        pad = total - real
        scratch = SCRATCH_PAGE * self.allocator.page_size
        page_rows = [t + [SCRATCH_PAGE] * (width - len(t)) for t in tables]
        page_rows += [[SCRATCH_PAGE] * width] * (num_slots - len(batch))
        dev = self.device
        meta = StepMetadata(
            slot_mapping=torch.tensor(slots + [scratch] * pad, dtype=torch.int64).to(dev),
            valid=torch.tensor([True] * real + [False] * pad).to(dev),
            kv_lens=torch.tensor(kv_lens + [0] * (num_slots - len(batch)), dtype=torch.int32).to(dev),
            page_indices=torch.tensor(page_rows, dtype=torch.int32).to(dev),
            cu_q_lens=torch.tensor(cu + [real] * (num_slots - len(batch)), dtype=torch.int32).to(dev),
            num_seqs=torch.tensor([len(batch)], dtype=torch.int32).to(dev),
            max_q_len=total if xla else None,
        )
        input_ids = torch.tensor([ids + [0] * pad]).to(dev)
        position_ids = torch.tensor([positions + [0] * pad]).to(dev)
        return input_ids, position_ids, meta


def _position_offset(model: torch.nn.Module) -> int:
    """The first position id: past the padding index where the embeddings number positions from there (RoBERTa's
    `create_position_ids_from_input_ids`: padding_idx + 1 on), else 0."""
    for module in model.modules():
        if hasattr(module, "create_position_ids_from_input_ids") and isinstance(getattr(module, "padding_idx", None), int):
            return module.padding_idx + 1
    return 0


def _bucket(n: int, smallest: int = 8) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


def runs_ragged_attention(model: torch.nn.Module, geometry: AttentionGeometry) -> bool:
    """Whether `model` (from `load_model`) attends through the ragged paged attention, whose arithmetic a
    runner's `attention_numerics` chooses: not a model with its own attention code (it reads a cache view), nor
    MLA (`runtime.latent` attends over the latents)."""
    return model.config._attn_implementation == ATTN_IMPLEMENTATION and geometry.latent is None


def _resolve_backend(choice: str, device: RuntimeDevice) -> str:
    if choice == "auto":  # on any XLA device the attention vLLM's TPU backend calls
        return "xla" if device.is_xla else "torch"
    if choice == "xla" and not device.is_xla:
        raise Fp8kvError(f"attention backend 'xla' needs an XLA device, not {device.kind!r}; use --device xla-cpu")
    if choice not in ("torch", "xla"):
        raise Fp8kvError(f"unknown attention backend {choice!r}; choose one of auto, torch, xla")
    return choice


def _resolve_numerics(requested: AttentionNumerics | None, backend: str, use_kernel: bool) -> AttentionNumerics:
    """The attention arithmetic that runs: the torch backend's as requested (float32 by default); on the xla
    backend torch_xla's own, which a request must name."""
    if requested is not None and requested not in NUMERICS:
        raise Fp8kvError(f"unknown attention numerics {requested!r}; choose one of {', '.join(NUMERICS)}")
    if backend == "torch":
        return requested or "float32"
    runs = "pallas-kernel" if use_kernel else "xla-reference"
    if requested not in (None, runs):
        raise Fp8kvError(f"attention numerics {requested!r}: torch_xla's function runs {runs!r} here; "
                         "choose the torch attention backend to reproduce another arithmetic")
    return runs


@contextmanager
def transformers_attention(model: torch.nn.Module, attention: str | None = None) -> Iterator[torch.nn.Module]:
    """`model` running transformers' attention `attention` (None: the one transformers picks for it) inside the
    block and the paged attention again after, so the runners' one copy of the weights also serves a plain
    transformers forward."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention or model._check_and_adjust_attn_implementation(None))
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The checkpoint's language model (`checkpoint.load.load_language_model`) on `device`, running the paged
    attention where it can; shareable between runners. On a CPU without a fast kernel for its dtype a 16-bit
    model's linear layers sum in float32 (`runtime.linear`): a GPU's arithmetic, at float32's speed."""
    _register()
    name = "auto" if dtype is None else {d: n for n, d in MODEL_DTYPES.items()}[dtype]
    model = load_language_model(model_dir, device, name, paged_attention=ATTN_IMPLEMENTATION)
    if torch.device(device).type == "cpu":
        sum_linears_in_float32(model)
    return model
