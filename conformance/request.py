"""What `fp8kv conformance reference` and `simulate` are asked to do, as frozen types, and the behaviours a pack
holds. Importable without torch: the command line reads its defaults here and checks --bug and --scale-factor
before anything heavy loads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fp8kv.engine_models import BUGS, DEFAULT_ENGINE, engine_model
from fp8kv.errors import Fp8kvError
from fp8kv.options import DEFAULT_MODE

CORRECT = "correct"
# Every behaviour a pack tells apart: the correct write, then each bug model.
BEHAVIOURS = (CORRECT, *BUGS)
# The factors the source's scales are tried with: below 1, K/V values above factor x the calibration amax
# cross the fp8 maximum, which exercises the clamp; too low, and several bugs all end in NaN everywhere.
SCALE_FACTORS = (0.25, 0.5, 0.75, 0.9, 1.0)


def behaviour_engine(name: str) -> str:
    """The engine model a behaviour runs: the default engine for "correct", else the bug model itself."""
    if name == CORRECT:
        return DEFAULT_ENGINE
    if name not in BUGS:
        raise Fp8kvError(f"unknown behaviour {name!r}; choose {CORRECT} or one of {', '.join(BUGS)}")
    return engine_model(name).name


def check_scale_factor(factor: float) -> float:
    """A factor the pack's scales may be multiplied by: above 0 (a scale of 0 divides by zero), at most 1 (above,
    nothing would cross the fp8 maximum the clamp behaviours differ on)."""
    if not (0 < factor <= 1 and math.isfinite(factor)):
        raise Fp8kvError(f"--scale-factor {factor:g} must be in (0, 1]")
    return factor


@dataclass(frozen=True)
class ReferenceRequest:
    """Everything `reference` needs; `fp8kv conformance reference` takes its defaults from here."""

    model_dir: Path  # a checkpoint with KV scales
    out: Path  # the pack folder
    scale_factor: float | None = None  # None: the one of SCALE_FACTORS under which the behaviours lie furthest apart
    device: str = "cpu"
    mode: str = DEFAULT_MODE  # how PACK/model holds the weights


@dataclass(frozen=True)
class SimulateRequest:
    """Everything `simulate` needs; `fp8kv conformance simulate` takes its defaults from here."""

    pack_dir: Path
    behaviour: str  # CORRECT or a bug model's name
    out: Path  # the JSONL answer file
    device: str = "cpu"
