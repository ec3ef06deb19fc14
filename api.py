"""fp8kv as a library: the K/V scales of a live transformers model, and the command line's drivers.

What replaces vLLM's removed `--calculate-kv-scales` in RL rollouts and notebooks: the model already in
memory is observed where it is (its device, its dtype, its own forward), the scales come from the one formula,
and the folder written is the one `fp8kv verify`, `fp8kv load-check`, vLLM and SGLang read.

    from fp8kv import api
    statistics = api.observe_model(model, texts, tokenizer=tokenizer)
    scales = api.scales_from(statistics)
    api.save_scales(scales, "path/to/model", "path/to/out")

    with api.observing(model) as observation:   # statistics of whatever the block runs
        model.generate(**inputs)
    api.scales_from(observation.statistics())
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from fp8kv import __version__
from fp8kv.calibrate import pipeline
from fp8kv.calibrate.pipeline import SCALE_FORMULA, CalibrationResult, layer_rows, query_scales
from fp8kv.calibrate.request import CalibrationRequest
from fp8kv.calibrate.scales import ScaleTable, compute_scales
from fp8kv.checkpoint.artifacts import check_writable_location
from fp8kv.checkpoint.conventions import CONVENTIONS, check_representable
from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.load import takes_attention_function
from fp8kv.checkpoint.locate import infer_base_model, resolve_model
from fp8kv.checkpoint.provenance import MemoryRecord, Provenance, QueryScaleRecord, SourceRecord
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.writer import MODES, check_output, check_weight_method, write_checkpoint
from fp8kv.data import Batch, DataRequest, make_batches, pad_id, tokenize_texts
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry, LatentCache
from fp8kv.loadcheck import live
from fp8kv.loadcheck.live import EngineScaleCheck, HeldCopy, render_engine_check
from fp8kv.loadcheck.run import LayerLoad
from fp8kv.observe import KVStatistics, ObservationStep, Progress, fold_update, observe, query_observer_for
from fp8kv.options import DEFAULT_MODE, LAST_BATCH, Strategy
from fp8kv.progress import StageProgress
from fp8kv.transformers_cache import model_cache_class, new_cache
from fp8kv.verify import run as verify_run
from fp8kv.verify.request import VerifyRequest
from fp8kv.verify.run import VerifyResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "Batch", "CalibrationRequest", "CalibrationResult", "DataRequest", "EngineScaleCheck", "Fp8kvError", "HeldCopy",
    "KVScales", "KVStatistics", "LayerLoad", "LiveObservation", "ScaleSet", "ScaleTable", "VerifyRequest",
    "VerifyResult", "calibrate", "check_engine_scales", "model_geometry", "observe_model", "observing",
    "render_engine_check", "save_scales", "scales_from", "send_scales", "verify",
]

BatchLike = Union[Batch, tuple[torch.Tensor, torch.Tensor], Mapping[str, Any]]
"""One batch of token ids with its attention mask (1 = real token): a `Batch`, a pair, or a tokenizer's output."""
Text = Union[str, list[dict[str, Any]]]
"""A text, or chat messages (`[{"role": ..., "content": ...}]`) put through the tokenizer's chat template."""
_CACHE_KEYWORDS = ("cache", "past_key_values")  # transformers 5 renames the second to the first
# Cache updates wait in a buffer of at most this many K and V elements and are folded together when it is full or
# the statistics are read: a decode step hands each layer one token per sequence, and folding that alone costs
# the fixed overhead of a few dozen small ops. A larger update (a long prompt's) is folded at once.
_BUFFER_ELEMENTS = 1 << 19
_Update = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]  # a buffered update: layer, K, V, valid


@dataclass(frozen=True)
class ScaleSet:
    """What `scales_from` computed: `table` (per layer: amax, clip, scale, saturation; calibrate's `ScaleTable`) and
    `scales` (the float32 K/V, and Q, scales a checkpoint holds, by layer), as `CalibrationResult` holds them.

    `num_layers`: the model's layers; `num_tokens`: real tokens folded per cache layer (the most over layers);
    `query_amax`: max |Q| per layer where Q was observed.
    """

    table: ScaleTable
    scales: KVScales
    strategy: str
    num_layers: int
    num_tokens: int
    query_amax: dict[int, float] | None = None


def calibrate(request: CalibrationRequest, progress: StageProgress | None = None) -> CalibrationResult:
    """`fp8kv calibrate` as a function: load `request.model`, observe, compute and (with `request.out`) write."""
    return pipeline.calibrate(request, progress)


def verify(request: VerifyRequest, progress: StageProgress | None = None) -> VerifyResult:
    """`fp8kv verify` as a function: the static and held-out checks, the verdict and the report files."""
    return verify_run.verify(request, progress)


def model_geometry(model: PreTrainedModel) -> AttentionGeometry:
    """The attention geometry of a live model, read from its config exactly as from a checkpoint's config.json."""
    _check_model(model)
    return AttentionGeometry.from_config(model.config.to_dict(), f"{type(model).__name__}'s config")


def observe_model(
    model: PreTrainedModel,
    batches: Iterable[BatchLike] | BatchLike | Iterable[Text] | Text,
    *,
    tokenizer: Any = None,
    batch_size: int = CalibrationRequest.batch_size,
    seq_len: int = DataRequest.seq_len,
    query: bool = False,
    progress: Progress | None = None,
) -> KVStatistics:
    """Fold the K/V each cache layer of `model` receives over `batches` into statistics (CPU), as `fp8kv calibrate`.

    The model runs in place: its own device, dtype and forward, under `torch.no_grad()`, in eval mode for the
    call (each module's mode is restored after). `batches` are token batches with their attention masks (left
    padding is moved right, so every sample starts at position 0 as a served prompt does), or texts with
    `tokenizer`, cut at `seq_len` tokens and batched `batch_size` at a time as calibration batches them.
    `query=True` also folds max |Q| per layer (`KVStatistics.query`), through an attention function set for the
    call and then restored.
    """
    geometry = model_geometry(model)
    prepared = _prepared(batches, tokenizer, batch_size, seq_len)
    amax_q = torch.zeros(geometry.num_layers) if query else None
    with _eval_mode(model), _query_attention(model, query):
        statistics = observe(model, prepared, geometry, progress, amax_q)
    silent = [layer for layer in geometry.kv_layers if int(statistics.tokens[layer]) == 0]
    if silent:
        raise Fp8kvError(f"{type(model).__name__}: layers {silent} own a K/V cache by the config but never passed K/V "
                         "to the cache's update in the forward, so fp8kv cannot see what they would cache")
    statistics.query = amax_q
    return statistics


def scales_from(
    statistics: KVStatistics,
    *,
    headroom: float = CalibrationRequest.headroom,
    kv_dtype: str = CalibrationRequest.kv_dtype,
    strategy: str = CalibrationRequest.strategy,
    per_head: bool = CalibrationRequest.per_head,
    layers: Sequence[int] | None = None,
) -> ScaleSet:
    """Scales by `fp8kv calibrate`'s formula (`calibrate.scales.compute_scales`) and defaults.

    `layers`: the cache-owning layers to scale; None takes every layer that folded a token (what
    `observe_model` checked against the config). A zero, non-finite or unobserved layer is refused.
    """
    if not isinstance(statistics, KVStatistics):
        raise Fp8kvError(f"statistics: expected KVStatistics (from observe_model or observing), "
                         f"got {type(statistics).__name__}")
    parsed = Strategy.parse(strategy)
    if parsed.name == LAST_BATCH:
        raise Fp8kvError("strategy last-batch needs the final batch's statistics alone, which the API does not keep; "
                         "use amax, percentile:P or mse")
    tokens = statistics.tokens.cpu()
    chosen = tuple(layers) if layers is not None else tuple(i for i in range(statistics.num_layers) if tokens[i] > 0)
    if not chosen:
        raise Fp8kvError("statistics: no layer folded any K/V; run observe_model, or the model inside observing, first")
    table = compute_scales(statistics, chosen, kv_dtype=kv_dtype, strategy=parsed, headroom=headroom,
                           per_head=per_head)
    q = None if statistics.query is None else query_scales(statistics.query, chosen, kv_dtype, headroom)
    scales = KVScales.from_tensors(k=table.tensors(0), v=table.tensors(1), kv_dtype=kv_dtype, q=q)
    query_amax = None if statistics.query is None else {i: float(statistics.query[i]) for i in chosen}
    return ScaleSet(table, scales, str(parsed), statistics.num_layers, int(tokens[list(chosen)].max()), query_amax)


def save_scales(
    scales: ScaleSet,
    source: str | Path | PreTrainedModel,
    out_dir: str | Path,
    *,
    convention: str = CalibrationRequest.convention,
    mode: str = DEFAULT_MODE,
    overwrite: bool = False,
    tokenizer: Any = None,
) -> Path:
    """Write `source` with `scales` in `convention` to `out_dir`, atomically, as `fp8kv calibrate --out`; return it.

    `source` is the checkpoint the scales go with (a folder, `bundled`, a Hub id; `mode` overlay links its
    weights), or the live model itself, whose weights (and `tokenizer`, when given) are saved with
    `save_pretrained` first: in RL the weights in memory are the ones observed, not the folder they came from.
    fp8kv.json records that the scales were observed in memory, and the source folder when one was given.
    """
    _check_save(scales, convention, mode)
    out = Path(out_dir).absolute()
    if isinstance(source, (str, Path)):
        folder = resolve_model(str(source))
        return _write(scales, folder, out, convention, mode, overwrite, str(source))
    _check_fits(scales, model_geometry(source), f"{type(source).__name__}'s config")
    check_writable_location(out)
    staging = out.parent / f".{out.name}.fp8kv-weights-{os.getpid()}"  # beside out: hard links stay on one device
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        check_output(staging, out, overwrite)
        source.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        return _write(scales, staging, out, convention, mode, overwrite, None)
    except OSError as exc:
        raise Fp8kvError(f"{out}: cannot save the model's weights ({exc.strerror}: {exc.filename})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_save(scales: ScaleSet, convention: str, mode: str) -> None:
    if not isinstance(scales, ScaleSet):
        raise Fp8kvError(f"scales: expected a ScaleSet (from scales_from), got {type(scales).__name__}")
    if convention not in CONVENTIONS:
        raise Fp8kvError(f"convention {convention!r}: choose one of {', '.join(CONVENTIONS)}")
    if mode not in MODES:
        raise Fp8kvError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    if scales.scales.q is not None and convention != "compressed-tensors":
        raise Fp8kvError("the scales hold q_scale, which only the compressed-tensors convention carries")
    check_representable(convention, scales.scales.strategy, scales.scales.kv_dtype)


def _check_fits(scales: ScaleSet, geometry: AttentionGeometry, where: str) -> None:
    if geometry.num_layers != scales.num_layers or tuple(geometry.kv_layers) != scales.table.layers:
        raise Fp8kvError(f"{where}: {geometry.num_layers} layers with K/V caches in {list(geometry.kv_layers)}, but the "
                         f"scales are of a {scales.num_layers}-layer model with caches in {list(scales.table.layers)}")


def _write(scales: ScaleSet, folder: Path, out: Path, convention: str, mode: str, overwrite: bool,
           named: str | None) -> Path:
    """The writer's overlay of `folder`; `named`: how the caller named the source folder (None: weights saved here)."""
    source = SourceCheckpoint.open(folder)
    _check_fits(scales, source.geometry, str(source.path / "config.json"))
    check_output(source.path, out, overwrite)
    check_weight_method(convention, source)
    record = Provenance(
        version=__version__, command=None, format=convention,
        source=None if named is None else SourceRecord(str(source.path), source.content_hash(),
                                                       infer_base_model(named, source.path)),
        strategy=scales.strategy, headroom=scales.table.headroom, scale_formula=SCALE_FORMULA,
        kv_dtype=scales.scales.kv_dtype, fp8_max=scales.scales.fp8_max, per_head=scales.table.per_head,
        memory=MemoryRecord(scales.num_tokens, weights_saved=named is None),
        skipped_layers=source.geometry.skipped_layers, defaulted_layers=scales.table.defaulted,
        layers=layer_rows(scales.table),
        query_scales=None if scales.query_amax is None or scales.scales.q is None else tuple(
            QueryScaleRecord(i, scales.query_amax[i], scales.scales.q[i]) for i in scales.table.layers),
    )
    return write_checkpoint(source.path, out, scales.scales, convention=convention, mode=mode, overwrite=overwrite,
                            record=record)


def send_scales(engine: Any, scales: ScaleSet | KVScales) -> None:
    """Hand per-tensor K/V scales to every attention layer of a running vLLM engine (`vllm.LLM`) through
    `engine.collective_rpc`, every copy vLLM keeps, tensors in place; then reset its prefix cache, whose blocks
    were quantized with the old scales. Q scales are not sent.

    Call it between rollouts, with no request running. With vLLM's engine core in a process of its own, set
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` before the engine starts, so that the function reaches the workers
    (fp8kv must be importable there too).
    """
    live.send_scales(engine, _kv_scales(scales))


def check_engine_scales(engine: Any, sent: ScaleSet | KVScales) -> EngineScaleCheck:
    """What every attention layer of a running vLLM engine holds, read through `engine.collective_rpc` from every
    worker and every copy vLLM keeps, against `sent` (the scales last handed over, or loaded).

    After a weight update, a `reload_weights`, a `sleep`/`wake_up`: `ok` says whether the scales survived, and
    `render_engine_check` what each layer holds instead.
    """
    return live.check_engine_scales(engine, _kv_scales(sent))


def _kv_scales(scales: ScaleSet | KVScales) -> KVScales:
    if isinstance(scales, ScaleSet):
        return scales.scales
    if isinstance(scales, KVScales):
        return scales
    raise Fp8kvError(f"scales: expected a ScaleSet (from scales_from) or KVScales, got {type(scales).__name__}")


class LiveObservation:
    """What `observing` yields: the K/V statistics of every forward the model ran inside the block.

    `statistics()` is a CPU copy of what was folded so far; `reset()` starts again (between RL steps).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        geometry = model_geometry(model)
        self._statistics = KVStatistics.empty(geometry.num_layers, geometry.num_kv_heads, _device(model))
        self._layers = frozenset(geometry.kv_layers)
        self._latent = LatentCache.from_config(model.config.get_text_config(decoder=True), f"{type(model).__name__}")
        self._base = model.base_model
        self._step: ObservationStep | None = None
        self._buffer: list[_Update] = []
        self._buffered = 0  # K and V elements in the buffer
        self._patched: list[tuple[weakref.ref, Callable[..., Any], Any]] = []

    def statistics(self) -> KVStatistics:
        """What was folded since the block began or the last `reset`, copied to the CPU."""
        self._fold_buffer()
        s = self._statistics
        return KVStatistics(*(t.detach().to("cpu", copy=True) for t in (s.amax, s.hist, s.tokens)))

    def reset(self) -> None:
        """Forget everything folded so far."""
        self._buffer, self._buffered = [], 0
        for tensor in (self._statistics.amax, self._statistics.hist, self._statistics.tokens):
            tensor.zero_()

    @property
    def num_tokens(self) -> int:
        """Real tokens folded per cache layer so far (the most over layers)."""
        self._fold_buffer()
        return int(self._statistics.tokens.max())

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The base model's forward pre-hook: which tokens are real, and a cache whose updates fold into this."""
        if len(args) > 1:
            raise Fp8kvError("observing: call the model with keyword arguments (only input_ids may be positional)")
        name = next((key for key in _CACHE_KEYWORDS if kwargs.get(key) is not None), None)
        if name is None:  # the model would make its own cache inside the forward, out of reach: hand it one
            name = next((key for key in _CACHE_KEYWORDS if key in _parameters(module)), _CACHE_KEYWORDS[1])
            kwargs[name] = new_cache(model_cache_class(module), module)
        self._patch(kwargs[name])
        self._step = ObservationStep(self._statistics, _valid_tokens(args, kwargs), self._layers)
        return args, kwargs

    def _after_forward(self, *_: Any) -> None:
        """The base model's forward hook: no step is open until the next forward."""
        self._step = None

    def _fold(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        step = self._step
        if step is None:  # an update outside a forward of the base model: not one fp8kv can place
            return
        size = key.numel() + value.numel()
        plain = self._latent is None and layer in self._layers and key.shape[1] <= self._statistics.amax.shape[2]
        if plain and size <= _BUFFER_ELEMENTS:
            if self._buffered + size > _BUFFER_ELEMENTS:
                self._fold_buffer()
            self._buffer.append((layer, key.detach(), value.detach(), step.valid))  # no autograd graph kept
            self._buffered += size
            return
        with torch.no_grad():
            fold_update(step, self._latent, layer, key, value)

    def _fold_buffer(self) -> None:
        """Fold the buffered updates, those alike in shape and of one forward (one `valid`) together."""
        groups: dict[tuple[Any, ...], list[_Update]] = {}
        for update in self._buffer:
            _, key, value, valid = update
            groups.setdefault((key.shape, value.shape, key.dtype, value.dtype, id(valid)), []).append(update)
        self._buffer, self._buffered = [], 0
        with torch.no_grad():
            for group in groups.values():
                layers, keys, values, valids = zip(*group)
                self._statistics.fold_layers(layers, keys, values, valids[0])

    def _patch(self, cache: Any) -> None:
        """Fold each `cache.update` (on this object only: other caches and models are untouched)."""
        if any(ref() is cache for ref, _, _ in self._patched):
            return
        original, own = cache.update, vars(cache).get("update")

        def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
            self._fold(layer_idx, key_states, value_states)
            return original(key_states, value_states, layer_idx, *args, **kwargs)

        cache.update = update
        self._patched.append((weakref.ref(cache), update, own))

    def _unpatch(self) -> None:
        for ref, update, own in self._patched:
            cache = ref()
            if cache is not None and vars(cache).get("update") is update:
                if own is None:
                    del cache.update
                else:
                    cache.update = own
        self._patched.clear()


@contextlib.contextmanager
def observing(model: PreTrainedModel) -> Iterator[LiveObservation]:
    """Fold the K/V of every forward `model` runs inside the block (`model.generate`, a rollout loop).

    The model's own code runs unchanged, in whatever mode and grad state the caller chose; each cache it hands
    its layers folds into the yielded `LiveObservation` (on the model's device), and the padding a 2-d
    attention mask marks is left out. On exit the model and its caches are as they were.
    """
    observation = LiveObservation(model)
    base = observation._base
    handles = [base.register_forward_pre_hook(observation._before_forward, with_kwargs=True),
               base.register_forward_hook(observation._after_forward, always_call=True)]
    try:
        yield observation
    finally:
        for handle in handles:
            handle.remove()
        observation._unpatch()
        observation._fold_buffer()


def _valid_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """bool [batch, new tokens]: the real tokens among the forward's new ones (None: all), from its 2-d mask."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if mask is None or tokens is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < tokens.shape[1]:
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise Fp8kvError(f"observing: the forward got attention_mask {shape}; fp8kv reads the real tokens from a "
                         "2-d [batch, past + new tokens] mask (transformers' dynamic cache passes one)")
    new = mask[:, -tokens.shape[1]:]
    return None if bool(new.all()) else new.bool()


def _check_model(model: Any) -> None:
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "base_model")):
        raise Fp8kvError(f"model: expected a transformers model (a PreTrainedModel), got {type(model).__name__}")


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _parameters(module: torch.nn.Module) -> Sequence[str]:
    import inspect

    return list(inspect.signature(module.forward).parameters)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout), as the driver loads the model; every module's own mode comes back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _query_attention(model: PreTrainedModel, query: bool) -> Iterator[None]:
    """With `query`: the attention function that also folds Q (`observe.query_observer_for`), for the block only."""
    if not query:
        yield
        return
    if not takes_attention_function(model.config):
        raise Fp8kvError(f"{type(model).__name__}: computes attention in its own code, so fp8kv cannot observe its "
                         "query (query=True); observe K/V only")
    previous = model.config._attn_implementation
    model.set_attn_implementation(query_observer_for(model.config.to_dict()))
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _prepared(batches: Any, tokenizer: Any, batch_size: int, seq_len: int) -> list[Batch]:
    """`batches` as the driver's right-padded `Batch`es: texts tokenized and batched, token batches checked."""
    one = isinstance(batches, (str, torch.Tensor, Batch, Mapping)) or _is_chat(batches) or _is_pair(batches)
    items = [batches] if one else list(batches)
    if not items:
        raise Fp8kvError("batches: empty; give token batches (input_ids with attention_mask) or texts")
    if all(isinstance(item, str) or _is_chat(item) for item in items):
        if tokenizer is None:
            raise Fp8kvError("batches are texts: pass tokenizer= (the model's own) to tokenize them")
        if seq_len < 1 or batch_size < 1:
            raise Fp8kvError(f"seq_len and batch_size must be at least 1, got {seq_len} and {batch_size}")
        samples = tokenize_texts(items, tokenizer, seq_len)
        if not samples:
            raise Fp8kvError(f"batches: all {len(items)} texts are empty")
        return make_batches(samples, batch_size, pad_id(tokenizer))
    return [_as_batch(item, index) for index, item in enumerate(items)]


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)


def _as_batch(item: Any, index: int) -> Batch:
    """One token batch, checked, with right padding (`Batch`)."""
    where = f"batch {index}"
    if isinstance(item, Batch):
        ids, mask = item.input_ids, item.attention_mask
    elif isinstance(item, Mapping) and "input_ids" in item:
        ids, mask = item["input_ids"], item.get("attention_mask")
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        ids, mask = item
    elif isinstance(item, torch.Tensor):
        raise Fp8kvError(f"{where}: a bare tensor of token ids; pass (input_ids, attention_mask), so that padding "
                         "is never observed (torch.ones_like(input_ids) when nothing is padded)")
    else:
        raise Fp8kvError(f"{where}: {type(item).__name__} is neither a text nor (input_ids, attention_mask)")
    if mask is None:
        raise Fp8kvError(f"{where}: has no attention_mask; fp8kv needs it to leave padding out")
    try:
        ids, mask = torch.as_tensor(ids), torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise Fp8kvError(f"{where}: input_ids and attention_mask must be rectangular tensors ({exc})") from None
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise Fp8kvError(f"{where}: input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} must both be "
                         "[batch, seq]")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise Fp8kvError(f"{where}: input_ids are {ids.dtype}; token ids are integers")
    if not bool(((mask == 0) | (mask == 1)).all()) or not bool(mask.any()):
        raise Fp8kvError(f"{where}: attention_mask must hold 0 (padding) and 1 (real token), with a real token")
    return _right_padded(ids.long(), mask.long(), where)


def _right_padded(ids: torch.Tensor, mask: torch.Tensor, where: str) -> Batch:
    """Each row's real tokens moved to start at position 0 (a left-padded row is shifted; one run per row)."""
    real = mask.bool()
    count = real.sum(1, keepdim=True)  # [batch, 1]
    first = real.int().argmax(1, keepdim=True)  # [batch, 1], 0 for an empty row
    positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
    run = (positions >= first) & (positions < first + count)
    holes = (run != real).any(1).nonzero().flatten().tolist()
    if holes:
        raise Fp8kvError(f"{where}: rows {holes[:5]} have padding between real tokens; give one run of real tokens per "
                         "row (pack samples as separate rows)")
    if not bool(first.any()):
        return Batch(ids, mask)
    index = (positions + first).clamp(max=ids.shape[1] - 1)
    return Batch(ids.gather(1, index), (positions < count).long())
