"""Which released engines serve a checkpoint's scales: per engine release, what its own loader holds for this model
class and format, as `EngineModel.for_checkpoint` resolves it from the loader matrix, in the one line that
calibrate's closing lines, the model card and verify print.

    for line in serving_lines(serving(traits_of(out, "compressed-tensors", per_head=False))): print(line)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8kv.engine_models import (
    FP8_K_NVFP4_V_RELEASES, HOLDS_ROUNDED, NVFP4_LOADERS, RELEASED, REACHES_CACHE, CheckpointTraits, EngineModel,
    Fp8KNvfp4VRelease, Nvfp4Loader, Nvfp4Traits, engine_model, engine_of,
)
from fp8kv.checkpoint.conventions import HF_QUANT_CONFIG, weight_method
from fp8kv.checkpoint.nvfp4 import convention_for_factor
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import read_json
from fp8kv.kvdtypes import E2M1_MAX, FP8_MAX
from fp8kv.options import FP8_K_NVFP4_V

# a release with a loader matrix holds the scales, one without reads the convention by its row
HOLDS, READS, NOT_RUN, NOT_STARTED, UNCHECKED = "holds", "reads", "not run", "does not start", "unchecked"
# what calibrate, the card and verify say of an fp8_k_nvfp4_v folder (configs/engines.toml's [[fp8_k_nvfp4_v]])
NO_FP8_K_NVFP4_V_RELEASE = "No engine release fp8kv read has an fp8 K / nvfp4 V cache (ModelOpt's FP8_K_NVFP4_V)"


@dataclass(frozen=True)
class Serving:
    """One engine release serving a checkpoint (`model`, resolved for it) and the traits it was resolved for."""

    model: EngineModel
    traits: CheckpointTraits

    @property
    def engine(self) -> str:
        return engine_of(self.model.name)

    @property
    def outcome(self) -> str:
        """HOLDS or READS (the scales reach its cache), NOT_RUN (1.0), NOT_STARTED or UNCHECKED."""
        if not self.model.starts:
            return NOT_STARTED
        if self.model.ignores_scales:
            return NOT_RUN
        if self.model.unchecked:
            return UNCHECKED
        release = self.model.release
        return HOLDS if release is not None and release.loader else READS

    @property
    def reaches(self) -> bool:
        """Whether the scales reach this engine's cache as far as fp8kv knows (never for an unchecked class)."""
        return self.outcome in (HOLDS, READS)

    @property
    def line(self) -> str:
        """What this release does with the scales, in one line naming it; a loss names the route that works."""
        if not self.reaches:
            return loss_line(self.model)
        name, release, traits = self.model.name, self.model.release, self.traits
        assert release is not None  # only a released engine model reaches a cache
        formats = " and ".join(traits.conventions)
        if self.outcome == READS:
            return f"{name} reads {formats} scales: {release.known_by}, its loader not run per model class here"
        held = {release.held(a, c) for a in traits.architectures for c in traits.conventions} & set(REACHES_CACHE)
        values = "the file's values rounded to the model's dtype" if held == {HOLDS_ROUNDED} else "the file's values"
        return (f"{name}'s loader holds {values} in every attention layer of {', '.join(traits.architectures)} with "
                f"{formats} scales (run here, tests/golden/{release.loaders})")


def loss_line(model: EngineModel) -> str:
    """What a release resolved for a checkpoint (`EngineModel.for_checkpoint`) does instead of running its scales,
    naming the release, why, and the route that works; verify's findings say the same."""
    if not model.starts:
        return f"{model.name} does not start on this checkpoint: {model.unread}"
    if model.ignores_scales:
        return not_run(model.name, model.unread)
    assert model.unchecked, f"{model.name} runs the checkpoint's scales"
    return f"{model.name}: {model.unchecked}"


def not_run(name: str, why: str) -> str:
    """A release whose cache runs at 1.0 with this checkpoint, and why (verify's engine rows record `why`)."""
    return f"{name} does not run these scales: {why}"


def traits_of(folder: str | Path, convention: str, per_head: bool) -> CheckpointTraits:
    """The traits that decide what each release's loader does with `folder`'s scales: config.json's model classes,
    the convention the scales are written in, whether they are per KV head."""
    path = Path(folder)
    try:
        architectures = read_json(path / "config.json").get("architectures")
    except Fp8kvError:  # no readable config: no model class, so every loader matrix says unchecked
        architectures = None
    names = tuple(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else ()
    return CheckpointTraits(names, (convention,), per_head, str(path))


def serving(traits: CheckpointTraits, names: tuple[str, ...] = RELEASED) -> tuple[Serving, ...]:
    """Each of `names` (default: the newest release of every engine still released) resolved for `traits`."""
    return tuple(Serving(engine_model(name).for_checkpoint(traits), traits) for name in names)


def serving_lines(served: tuple[Serving, ...]) -> list[str]:
    """One line per engine release: those whose cache gets the scales first, then the losses with their routes."""
    return [s.line for s in served if s.reaches] + [s.line for s in served if not s.reaches]


def asked(traits: CheckpointTraits) -> str:
    """The model class and format the releases were resolved for, as a phrase."""
    classes = ", ".join(traits.architectures) or "a model class config.json does not name"
    return f"{classes}, {' and '.join(traits.conventions)}"


def serving_heading(traits: CheckpointTraits) -> str:
    """The line above the engine lines."""
    return f"what each engine release does with these scales ({asked(traits)}):"


def nvfp4_line(loader: Nvfp4Loader, divisor: float, headroom: float | None, traits: Nvfp4Traits) -> str:
    """What `loader`'s release runs as the global scale of a file storing `amax x headroom / divisor` (headroom None:
    unknown, written h) in a checkpoint of `traits`, and what that makes of the block scales: each is the block's max /
    (6 x global scale); a loss names the convert that stores the scales the other way."""
    refused = loader.refused(traits)
    if refused:
        return f"{loader.name}: does not start this model's NVFP4 cache: {refused} ({loader.known_by})"
    not_loaded = loader.not_loaded(traits)
    if not_loaded:
        return f"{loader.name}: {not_loaded}: the global scale stays 1.0 ({loader.known_by})"
    ran = divisor / loader.factor  # the global scale it runs is amax x headroom / ran
    how = "as stored" if loader.factor == 1.0 else f"x{loader.factor:g}" + (" (a stored 1.0 stays 1.0)"
                                                                             if loader.keeps_unit else "")
    bound = FP8_MAX["fp8_e4m3"]

    def per_h(value: float) -> str:  # a bound on the block scales (or codes x block scales), in numbers when h is
        return f"{value / headroom:.4g}" if headroom is not None else f"{value:.4g}/h"

    peak = ran / E2M1_MAX  # the largest block scale, times the headroom
    overflows = loader.fp8_dequant and ran / (headroom or 1.0) > bound
    if overflows:
        effect = f"its e4m3 dequantization overflows: e2m1 code x block scale reaches {per_h(ran)}, past {bound:g}"
    elif ran == bound:
        effect = f"block scales up to {per_h(peak)}, as amax / {bound:g} intends: nothing overflows"
    elif ran < bound:
        effect = (f"block scales only up to {per_h(peak)}, {bound / ran:g}x below what amax / {bound:g} intends: "
                  "small blocks reach e4m3's subnormals sooner, nothing overflows")
    else:
        effect = f"block scales up to {per_h(peak)}, within e4m3's {bound:g}"
    h = "h" if headroom is None else f"{headroom:g}"
    fixable = ran < bound or overflows  # another ModelOpt convention gives it amax / 448
    target = convention_for_factor(loader.factor) if fixable else None
    route = f"; fp8kv convert --to {target.name} gives it amax / {bound:g}" if target else ""
    runs = f"amax x {h} / {ran:.6g}" if loader.factor == 1.0 else \
        f"{loader.factor:g} x amax x {h} / {divisor:g} = amax x {h} / {ran:.4g}"
    return f"{loader.name}: {how} -> runs {runs}; {effect}{route} ({loader.known_by})"


def fp8_k_nvfp4_v_line(release: Fp8KNvfp4VRelease) -> str:
    """What `release` runs for an fp8_k_nvfp4_v folder, having no such cache."""
    return f"{release.name}: no fp8 K / nvfp4 V cache; runs {release.instead} ({release.known_by})"


def nvfp4_lines(divisor: float, headroom: float | None, kv_dtype: str, traits: Nvfp4Traits) -> list[str]:
    """One line per release and GPU generation fp8kv read (configs/engines.toml's [[nvfp4]]), for a checkpoint of
    `traits`; for fp8_k_nvfp4_v, one per release read and what it runs instead ([[fp8_k_nvfp4_v]])."""
    if kv_dtype == FP8_K_NVFP4_V:
        return [fp8_k_nvfp4_v_line(release) for release in FP8_K_NVFP4_V_RELEASES]
    return [nvfp4_line(loader, divisor, headroom, traits) for loader in NVFP4_LOADERS]


def nvfp4_traits_of(folder: str | Path) -> Nvfp4Traits:
    """The traits of `folder` an NVFP4 release's start and loader depend on: its K/V head_dims (config.json), and
    whether only its KV cache is quantized (config.json and hf_quant_config.json name no weight quantization)."""
    source = SourceCheckpoint.open(folder)  # the geometry fp8kv.json records, where it does: no transformers
    hf_quant = read_json(source.path / HF_QUANT_CONFIG) if HF_QUANT_CONFIG in source.files else None
    return Nvfp4Traits(source.geometry.head_dims, weight_method(source.config, hf_quant) is None)


def nvfp4_serve_commands(folder: str, kv_dtype: str) -> list[str]:
    """The commands that serve `folder` with an NVFP4 cache on each engine's newest release fp8kv read, one per
    cache it offers (vLLM's nvfp4 and nvfp4_4over6); none for fp8_k_nvfp4_v, which none of them has."""
    if kv_dtype == FP8_K_NVFP4_V:
        return []
    newest: dict[str, str] = {}
    for loader in NVFP4_LOADERS:  # each engine's rows newest first
        newest.setdefault(loader.engine, loader.release)
    return list(dict.fromkeys(loader.serve.format(model=folder) for loader in NVFP4_LOADERS
                              if loader.loads and loader.release == newest[loader.engine]))
