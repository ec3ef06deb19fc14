"""Hugging Face Hub ids as MODEL: `org/name[@revision]` resolved to a local snapshot folder.

huggingface_hub does the work (its cache, its token, its offline mode); this module only picks
which files to fetch (safetensors weights plus json/tokenizer files, never pickled `*.bin`) and
turns its exceptions into one-line `Fp8kvError`s that say how to get the model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fp8kv.errors import Fp8kvError

# What a checkpoint needs to load, and nothing that could be a pickle.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "README.md",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?$")
# models--org--name/snapshots/<commit>: where huggingface_hub keeps a downloaded revision.
_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}/?$")
_TRUE = {"1", "on", "yes", "true"}


def is_repo_id(value: str) -> bool:
    """True for a Hub repository id `org/name` (no revision) that is not an existing local path."""
    return looks_like_hub_id(value) and "@" not in value


def check_base_model(value: str) -> str:
    """`--base-model`: the Hub id of the source model, `org/name` (the card's base_model links to it)."""
    if not is_repo_id(value):
        raise Fp8kvError(f"--base-model {value!r}: not a Hub model id org/name")
    return value


def looks_like_hub_id(model: str) -> bool:
    """True for `org/name` or `org/name@revision` strings that are not an existing local path."""
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


def split_hub_id(spec: str) -> tuple[str, str | None]:
    """`"org/name@rev"` -> `("org/name", "rev")`; no `@` -> revision None."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def repo_id_from_cache_path(path: str | Path) -> str | None:
    """The Hub id of a huggingface_hub cache snapshot folder, or None for any other folder."""
    match = _CACHE_SNAPSHOT.search(Path(path).as_posix())
    return f"{match['org']}/{match['name']}" if match else None


def resolve_hub_model(spec: str) -> Path:
    """Resolve `org/name[@revision]` to a local snapshot folder through huggingface_hub.

    Uses the local cache first; with `HF_HUB_OFFLINE=1` it never touches the network.
    `HF_HUB_OFFLINE` and `HF_HUB_CACHE` are read at call time (huggingface_hub itself reads
    them once, at import). Raises `Fp8kvError` when the model is neither cached nor reachable,
    naming the command that downloads it.
    """
    from huggingface_hub import snapshot_download

    repo_id, revision = split_hub_id(spec)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except Exception as exc:  # noqa: BLE001 - every huggingface_hub failure becomes one line
        raise _resolve_error(spec, repo_id, revision, offline, exc) from exc
    return _checked_snapshot(Path(folder), spec)


def _checked_snapshot(folder: Path, spec: str) -> Path:
    if not (folder / "config.json").is_file():
        raise Fp8kvError(f"{spec}: the Hub snapshot at {folder} has no config.json; is it a model repository?")
    if not any(folder.glob("*.safetensors")):
        raise Fp8kvError(
            f"{spec}: the Hub snapshot at {folder} has no *.safetensors weights "
            "(fp8kv never loads pickled *.bin files); use a repository that ships safetensors"
        )
    return folder


def _resolve_error(spec: str, repo_id: str, revision: str | None, offline: bool, exc: Exception) -> Fp8kvError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    args = f"download {repo_id}" + (f" --revision {revision}" if revision else "")
    how = f"download it with `hf {args}` (or `huggingface-cli {args}`)"
    if isinstance(exc, HFValidationError):
        return Fp8kvError(f"{spec}: not a local folder and not a valid Hub id ({_first_line(exc)})")
    if isinstance(exc, GatedRepoError):
        return Fp8kvError(
            f"{spec}: the Hub repository is gated; accept its terms on the Hub, log in (`hf auth login`), then {how}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return Fp8kvError(f"{spec}: the Hub repository {repo_id} has no revision {revision!r}")
    if isinstance(exc, RepositoryNotFoundError):
        return Fp8kvError(
            f"{spec}: no local folder of that name and no Hub repository {repo_id} "
            "(or it is private: log in with `hf auth login`)"
        )
    if isinstance(exc, IncompleteSnapshotError):
        return Fp8kvError(
            f"{spec}: the local Hub cache holds only part of this model (an interrupted download?); {how}, then run again"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        where = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        return Fp8kvError(f"{spec}: not in the local Hub cache and {where}; {how}, then run again")
    return Fp8kvError(f"{spec}: could not resolve the Hub model ({type(exc).__name__}: {_first_line(exc)}); {how}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
