"""Fixtures shared by the whole suite."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fp8kv.models.factory import make_checkpoint


@pytest.fixture(scope="session")
def factory_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`factory_checkpoint(arch)`: the default factory checkpoint of `arch`, built once per session.

    Tests must treat these folders as read-only (copy one first to modify it); for other sizes
    or options call `make_checkpoint` into `tmp_path` directly.
    """
    root = tmp_path_factory.mktemp("factory")
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_checkpoint(arch, root / arch)
        return built[arch]

    return build


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A jsonl of six records of 10 to 60 tokens: several longer than the factory's sliding window (16)."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    texts = [topics[key][: 40 + 37 * i] for i, key in enumerate(sorted(topics)[:6])]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)
