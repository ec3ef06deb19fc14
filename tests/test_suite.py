"""The suite's own bookkeeping: every test named slow or only .venv can run exists."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SLOW, OLDEST_ONLY

TESTS = Path(__file__).resolve().parent


def test_every_slow_or_oldest_only_entry_names_a_test_function() -> None:
    missing = []
    for node_id in sorted(SLOW | OLDEST_ONLY):
        file, _, name = node_id.partition("::")
        path = TESTS / file
        functions = {n.name for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.FunctionDef)} if path.is_file() else set()
        if name.partition("[")[0] not in functions:
            missing.append(node_id)
    assert missing == [], f"tests/conftest.py SLOW or OLDEST_ONLY names tests that do not exist: {missing}"
