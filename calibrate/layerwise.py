"""Layer-by-layer observation: calibrate a model that does not fit in memory.

The causal LM is built on the meta device (no weight is allocated). Everything outside the
decoder layers (embeddings, norms, a vision-language wrapper's towers) is loaded and stays; the
embeddings of every batch are computed first; then one decoder layer at a time is read from the
safetensors files with transformers' own loader (only that layer's tensors, renamed and fused as
`from_pretrained` does: MoE experts stored one by one), every batch's hidden states go through it
while the observing cache folds K/V into the statistics, and the layer goes back to meta. Peak
memory is about one layer plus the embeddings plus the hidden states (kept in memory, or spilled
to a memory-mapped file when they do not fit).

Each layer receives exactly what the whole model would pass it: the model's own forward runs on
the batch's tokens with every decoder layer replaced by a catcher, so masks (causal, sliding
window, per-layer attention type), rotary and position embeddings, per-layer inputs (Gemma 3n)
and embedding scaling come from the model's code, not from a re-implementation. Batches are the
same as the whole-model path's, so the statistics, and the scales, are bit-identical.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from fp8kv.calibrate.distributed import shard_batches
from fp8kv.calibrate.request import CalibrationRequest
from fp8kv.checkpoint.load import MODEL_DTYPES, model_class
from fp8kv.transformers_cache import cache_kwargs
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.data import Batch, CalibrationData, make_batches, pad_id
from fp8kv.errors import Fp8kvError
from fp8kv.observe import KVStatistics, ObservationStep, Progress, observing_cache
from fp8kv.runtime.device import resolve_device

# Whole-model loading is chosen while the weights take at most this share of available memory.
WHOLE_MODEL_SHARE = 0.6
# Hidden states stay in memory while they take at most this share of what is left after a layer.
HIDDEN_SHARE = 0.5
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def available_memory() -> int:
    """Bytes of RAM the kernel can hand out now (MemAvailable), without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def weight_bytes(source: SourceCheckpoint, dtype: str = "auto") -> int:
    """Bytes the model's weights take once loaded in `dtype` (from the safetensors headers)."""
    target = MODEL_DTYPES.get(dtype)
    total = 0
    for header in source.headers.values():
        for entry in header.values():
            stored = SAFETENSORS_DTYPES.get(entry["dtype"], torch.uint8)
            size = (target if target is not None and stored.is_floating_point else stored).itemsize
            total += math.prod(entry["shape"]) * size
    return total


def choose_layerwise(choice: bool | None, source: SourceCheckpoint, dtype: str = "auto") -> bool:
    """`choice` when given; else layer by layer when the weights exceed WHOLE_MODEL_SHARE of free RAM.

    The whole-model path loads the weights into RAM first, even for a GPU, so RAM decides.
    """
    if choice is not None:
        return choice
    return weight_bytes(source, dtype) > WHOLE_MODEL_SHARE * available_memory()


def observe_layerwise(
    source: SourceCheckpoint,
    data: CalibrationData,
    request: CalibrationRequest,
    tokenizer: Any,
    progress: Progress | None = None,
    spill: bool | None = None,
) -> KVStatistics:
    """K/V statistics of every sample, computed one decoder layer at a time.

    `spill`: True keeps the hidden states in a memory-mapped file, False in memory,
    None decides from their size and the available memory.
    """
    device = resolve_device(request.device, torch_only=True).device
    model = build_skeleton(source, request.dtype, request.trust_remote_code)
    base, layers = model.base_model, decoder_layers(model, source.geometry.num_layers)
    names = {module: name for name, module in model.named_modules()}
    weights = stored_weights(source, model)
    materialize_buffers(model, device)
    batches = shard_batches(make_batches(data.samples, request.batch_size, pad_id(tokenizer)))
    last = max(source.geometry.kv_layers, default=-1)  # layers after the last cache-owning one never matter
    statistics = KVStatistics.empty(len(layers), source.geometry.num_kv_heads, device)
    observed = frozenset(source.geometry.kv_layers)
    total = sum(batch.input_ids.shape[0] for batch in batches) * (last + 1)
    done = 0
    # Embeddings and the like stay loaded: every layer's arguments are computed from them (GPT-2's position
    # embeddings, Gemma 3n's per-layer inputs), as in the whole model's forward.
    with torch.no_grad(), _spill_dir(request.out) as spill_root, loaded(weights, outside(base, layers), names, device):
        firsts = [capture(base, layers, 0, input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device))
                  for b in batches]
        store = HiddenStates([h for h, _, _ in firsts], spill, spill_root, device, _largest_layer(source))
        del firsts
        returns = 0
        for index in range(last + 1):
            with loaded(weights, [(layers[index], True)], names, device):
                for i, batch in enumerate(batches):
                    returns = run_layer(base, layers, index, batch, store, i, statistics, observed, device, returns)
                    done += batch.input_ids.shape[0]
                    if progress is not None:
                        progress(done, total)
    return statistics.cpu()


def run_layer(
    base: torch.nn.Module,
    layers: torch.nn.ModuleList,
    index: int,
    batch: Batch,
    store: HiddenStates,
    slot: int,
    statistics: KVStatistics,
    observed: frozenset[int],
    device: torch.device,
    returns: int = 0,
) -> int:
    """Run batch `slot`'s hidden states through `layers[index]`, folding its K/V, and store the output.

    The layer's arguments come from the model's forward on the batch's tokens; `returns` is how many
    values a decoder layer returns (0: a tensor), which the skipped earlier layers imitate. Returns it.
    """
    mask = batch.attention_mask.to(device)
    hidden = store.get(slot, device)  # [batch, seq, hidden]
    valid = mask.bool()
    step = ObservationStep(statistics, None if bool(valid.all()) else valid, observed)
    cache = observing_cache(base, step)
    _, args, kwargs = capture(base, layers, index, returns, input_ids=batch.input_ids.to(device), attention_mask=mask,
                              **cache_kwargs(base, cache))
    out = layers[index](hidden, *args, **kwargs)
    store.put(slot, out[0] if isinstance(out, tuple) else out)
    return len(out) if isinstance(out, tuple) else 0


def build_skeleton(source: SourceCheckpoint, dtype: str, trust_remote_code: bool) -> torch.nn.Module:
    """The causal LM, every parameter and buffer on the meta device."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = model_class(source.config).from_config(
            config,
            dtype=resolve_dtype(source, config, dtype),
            trust_remote_code=trust_remote_code,
        )
    return model.eval()


def resolve_dtype(source: SourceCheckpoint, config: Any, dtype: str) -> torch.dtype:
    """The dtype `from_pretrained(dtype=...)` would load in: the named one, else config's, else the weights'."""
    if dtype != "auto":
        if dtype not in MODEL_DTYPES:
            raise Fp8kvError(f"--dtype {dtype!r}: choose auto, {', '.join(MODEL_DTYPES)}")
        return MODEL_DTYPES[dtype]
    if getattr(config, "dtype", None) is not None:
        return getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    for header in source.headers.values():
        for entry in header.values():
            stored = SAFETENSORS_DTYPES.get(entry["dtype"])
            if stored is not None and stored.is_floating_point:
                return stored
    return torch.get_default_dtype()


# Names of the decoder layer list: `layers` (llama), `h` (gpt2, falcon, bloom), `blocks`, `layer` (BERT's encoder).
_LAYER_LISTS = ("layers", "h", "blocks", "layer")


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The decoder layers: the base model's `num_layers`-long layer list, nearest the base model first
    (`layers`, gpt2's `h`, a vision-language wrapper's `language_model.layers`)."""
    found = [(name.count("."), name, module) for name, module in model.base_model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers
             and name.rpartition(".")[2] in _LAYER_LISTS and not _TOWER.search(name)]
    if not found:
        raise Fp8kvError(
            f"{type(model).__name__}: no list of {num_layers} decoder layers on the base model; "
            "layer-by-layer calibration cannot run it (use --no-layerwise)"
        )
    return min(found, key=lambda entry: entry[:2])[2]


_TOWER = re.compile(r"vision|visual|audio")


def outside(root: torch.nn.Module, layers: torch.nn.ModuleList) -> list[tuple[torch.nn.Module, bool]]:
    """(module, whole subtree?) pairs that hold every parameter not under `layers`: embeddings, norms, towers
    (which stay loaded too: the model's `device` is its first parameter's), and the own parameters of the
    modules that contain the layers (LLaVA-NeXT's image_newline)."""
    inner = set(layers.modules())
    parts = [(root, False)] if root._parameters else []
    for child in root.children():
        if child is layers:
            continue
        if any(m in inner for m in child.modules()):
            parts.extend(outside(child, layers))
        else:
            parts.append((child, True))
    return parts


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Give non-persistent buffers (rotary inv_freq, embedding scales) their values, as from_pretrained does.

    They are not in the checkpoint; transformers' `initialize_weights` computes them from the config,
    each sub-model with its own `_init_weights` (a parent may fill its layers' buffers: Falcon-H1's
    MuP vector). The parameters stay on meta, where initializing them does nothing.
    """
    owned = [(module, name) for module in model.modules()
             for name in module._buffers if name in module._non_persistent_buffers_set]
    for module, name in owned:
        module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
    model.initialize_weights()
    for module, name in owned:
        module._buffers[name] = module._buffers[name].to(device)


@contextlib.contextmanager
def loaded(
    weights: StoredWeights, parts: list[tuple[torch.nn.Module, bool]], names: dict[torch.nn.Module, str],
    device: torch.device,
) -> Iterator[None]:
    """Read the parameters of `parts` ((module, its whole subtree or only its own)) from the checkpoint onto
    `device`; put them back on meta afterwards."""
    for module, subtree in parts:
        load_module(weights, module, names[module], device, subtree)
    try:
        yield
    finally:
        for module, subtree in parts:
            for sub in module.modules() if subtree else [module]:
                for name, param in list(sub._parameters.items()):
                    if param is not None:
                        sub._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)


@dataclass(frozen=True)
class StoredWeights:
    """The checkpoint's tensors as transformers loads them into `model`: `targets[stored name] = (weight file,
    the model tensor it becomes)` through transformers' renamings and conversions (`mapping`)."""

    path: Path
    model: torch.nn.Module
    mapping: list
    targets: dict[str, tuple[str, str]]


def stored_weights(source: SourceCheckpoint, model: torch.nn.Module) -> StoredWeights:
    """Where each model tensor comes from: a vision-language checkpoint's `language_model.model.` is the
    model's `model.language_model.`; experts stored one by one become one fused tensor per layer."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    # every renaming, then at most one converter, as loading does; transformers 5.17 to 5.20 have no other public way
    targets = {stored: (file, rename_source_key(stored, renamings, converters)[0])
               for stored, file in source.weight_map.items()}
    return StoredWeights(source.path, model, mapping, targets)


def load_module(weights: StoredWeights, module: torch.nn.Module, prefix: str, device: torch.device,
                subtree: bool = True) -> None:
    """Load `module` (named `prefix` in the model; with `subtree` False only its own parameters) from the
    checkpoint with transformers' own loader, as `from_pretrained` does (renamed and fused tensors included),
    each parameter in the skeleton's dtype."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    dtypes = {name: param.dtype for name, param in module.named_parameters(recurse=subtree)}
    own = {f"{prefix}.{name}" for name in dtypes}
    by_file: dict[str, list[str]] = {}
    for stored, (file, target) in weights.targets.items():
        if target in own or (subtree and target.startswith(prefix + ".")):
            by_file.setdefault(file, []).append(stored)
    state = {}
    for file, tensors in by_file.items():
        with safe_open(weights.path / file, framework="pt", device=str(device)) as handle:
            state.update({tensor: handle.get_tensor(tensor) for tensor in tensors})
    config = LoadStateDictConfig(weight_mapping=weights.mapping, device_map={"": device})
    convert_and_load_state_dict_in_model(weights.model, state, config)
    missing = sorted(f"{prefix}.{name}" for name, param in module.named_parameters(recurse=subtree) if param.is_meta)
    if missing:
        raise Fp8kvError(
            f"{weights.path}: tensor {missing[0]!r} is not in the checkpoint under a name transformers loads "
            "it from; layer-by-layer calibration needs it (use --no-layerwise)"
        )
    for name, param in module.named_parameters(recurse=subtree):
        if param.dtype != dtypes[name]:
            owner, _, leaf = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            target._parameters[leaf] = torch.nn.Parameter(param.to(dtypes[name]), requires_grad=False)


class _Caught(Exception):
    """Raised by the catcher to stop the model's forward at the layer being run."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args_, self.kwargs_ = args, kwargs


def capture(
    base: torch.nn.Module, layers: torch.nn.ModuleList, index: int, returns: int = 0, **inputs: Any
) -> tuple[torch.Tensor, tuple, dict]:
    """Run the base model's forward until it calls `layers[index]`; return that call's (hidden, args, kwargs).

    Earlier layers are skipped (identity, returning a tuple of `returns` values where layers return
    tuples, as Bamba's): only the arguments matter, and they do not depend on the hidden states'
    values. For index 0 with `input_ids`, the hidden states are the embeddings. With an observing
    cache among `inputs`, the layer's call carries it, as in the whole-model path.
    """

    def skip(hidden_states, *args, **kwargs):
        return (hidden_states, *[None] * (returns - 1)) if returns else hidden_states

    def catch(hidden_states, *args, **kwargs):
        raise _Caught((hidden_states, *args), kwargs)

    for i, layer in enumerate(layers[: index + 1]):
        layer.forward = catch if i == index else skip
    try:
        base(**{"use_cache": False, **inputs})
    except _Caught as caught:
        hidden, *args = caught.args_
        return hidden, tuple(args), caught.kwargs_
    finally:
        for layer in layers[: index + 1]:
            del layer.forward
    raise Fp8kvError(f"{type(base).__name__}: the forward never called decoder layer {index}; use --no-layerwise")


def _largest_layer(source: SourceCheckpoint) -> int:
    """Bytes of the largest decoder layer's stored tensors (`model.layers.N.`, `transformer.h.N.`), for the memory budget."""
    sizes: dict[str, int] = {}
    for header in source.headers.values():
        for tensor, entry in header.items():
            parts = tensor.split(".")
            at = next((i for i, part in enumerate(parts[:-2]) if part in _LAYER_LISTS and parts[i + 1].isdigit()), None)
            if at is not None:
                key = ".".join(parts[: at + 2])
                sizes[key] = sizes.get(key, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
    return max(sizes.values(), default=0)


@contextlib.contextmanager
def _spill_dir(out: Path | None) -> Iterator[Path]:
    """A temporary folder next to the output (same disk as the checkpoint being written), removed afterwards."""
    parent = None
    if out is not None:
        parent = out.expanduser().resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fp8kv-hidden-", dir=parent) as root:
        yield Path(root)


class HiddenStates:
    """Every batch's hidden states between two layers, in memory or in one memory-mapped file.

    Slot i holds batch i's [batch, seq, hidden] tensor; a layer's output overwrites its input
    in place, so one buffer is enough.
    """

    def __init__(
        self, first: list[torch.Tensor], spill: bool | None, root: Path, device: torch.device, layer_bytes: int
    ):
        shapes = [tuple(h.shape) for h in first]
        dtype = first[0].dtype
        needed = sum(math.prod(s) for s in shapes) * dtype.itemsize
        home = _home(needed, spill, device, layer_bytes)
        self.spilled = home == "disk"
        if self.spilled:
            flat = _mapped(root / "hidden.bin", sum(math.prod(s) for s in shapes), dtype)
            offsets = [0, *itertools.accumulate(math.prod(s) for s in shapes)]
            self.slots = [flat[a:b].view(s) for a, b, s in zip(offsets, offsets[1:], shapes)]
            for slot, h in zip(self.slots, first):
                slot.copy_(h)
        else:
            self.slots = [h.to(home) for h in first]

    def get(self, slot: int, device: torch.device) -> torch.Tensor:
        return self.slots[slot].to(device)

    def put(self, slot: int, hidden: torch.Tensor) -> None:
        if self.spilled:
            self.slots[slot].copy_(hidden)
        else:
            self.slots[slot] = hidden.to(self.slots[slot].device)


def _home(needed: int, spill: bool | None, device: torch.device, layer_bytes: int) -> torch.device | str:
    """Where hidden states live: the compute device, CPU memory, or "disk"."""
    if spill:
        return "disk"
    if device.type == "cuda" and needed <= HIDDEN_SHARE * (torch.cuda.mem_get_info(device)[0] - layer_bytes):
        return device
    if spill is False or needed <= HIDDEN_SHARE * (available_memory() - layer_bytes):
        return torch.device("cpu")
    return "disk"


def _mapped(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of `numel` elements backed by the file at `path` (shared mapping: writes go to disk)."""
    with open(path, "wb") as handle:
        handle.truncate(numel * dtype.itemsize)
    return torch.from_file(os.fspath(path), shared=True, size=numel, dtype=dtype)
