"""The import rules of ARCHITECTURE.md: each stage imports only the stages below it.

Read from the source with `ast`, so a new import that breaks a rule fails here with the file and
the import named. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import modules of its own part and of any part in an earlier layer;
# the last layer (entry points, and tools/: the builders of test and bundled models, not installed)
# may import anything. A part is a top-level module or package of fp8kv.
LAYERS: list[set[str]] = [
    {"errors", "json_fields", "ckernel"},
    {"options", "configs"},
    {"kvdtypes"},
    {"fp8", "geometry", "console", "progress", "models", "transformers_cache"},
    {"nvfp4"},
    {"engine_models"},
    {"checkpoint"},
    {"data", "observe", "runtime"},
    {"checks", "serving"},
    {"inspection", "calibrate"},
    {"verify", "loadcheck"},
    {"conformance"},
    {"evaluation"},
    {"hub"},
    {"api"},
    {"cli", "cli_conformance", "cli_parse", "__main__", "tools"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
PACKAGE = "fp8kv"


def product_modules() -> list[Path]:
    skip = {"tests", "bench", "probes", "build"}
    return sorted(p for p in ROOT.rglob("*.py")  # hidden folders (.venv, .venv-newest) hold no fp8kv module
                  if not any(part in skip or part.startswith(".") for part in p.relative_to(ROOT).parts))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def part_of(module: str) -> str:
    """The most specific entry of LAYERS that names `module` (a module, else its top-level part)."""
    pieces = module.split(".")
    for n in range(len(pieces), 0, -1):
        if ".".join(pieces[:n]) in RANK:
            return ".".join(pieces[:n])
    return pieces[0]


def fp8kv_imports(path: Path) -> list[str]:
    """Every fp8kv module `path` imports, as names below the package (`runtime.cache`, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            rest = node.module.split(".")[1:]
            found += [".".join(rest)] if rest else [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name.split(".", 1)[1] for a in node.names if a.name.startswith(PACKAGE + ".")]
    return found


def test_every_part_has_a_layer() -> None:
    parts = {part_of(module_name(p)) for p in product_modules()} - {"__init__"}
    assert sorted(parts - set(RANK)) == []


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_go_down(path: Path) -> None:
    here = part_of(module_name(path))
    if here == "__init__" or RANK[here] == len(LAYERS) - 1:
        return
    wrong = [target for target in fp8kv_imports(path)
             if target != "__version__" and part_of(target) != here and RANK[part_of(target)] >= RANK[here]]
    assert wrong == [], f"{path.relative_to(ROOT)} ({here}) imports {wrong}, which are not below it"
