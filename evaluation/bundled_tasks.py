"""lm_eval tasks fp8kv ships for its bundled model (CPython documentation), readable offline.

`TASKS_DIR` is an lm_eval include path: `fp8kv_pydoc_mc` (multiple choice), `fp8kv_pydoc_gen`
(the same questions, generated) and `fp8kv_pydoc_ppl` (rolling log-likelihood of the held-out split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8kv.models import BUNDLED_HELDOUT_TEXT

TASKS_DIR = Path(__file__).parent / "tasks"
QUESTIONS = TASKS_DIR / "pydoc_questions.jsonl"
BUNDLED_TASKS = ("fp8kv_pydoc_mc", "fp8kv_pydoc_gen", "fp8kv_pydoc_ppl")


def load_questions(**metadata: Any):
    """The question file as a `test` split (lm_eval passes its task metadata; nothing in it matters here)."""
    return _jsonl(QUESTIONS)


def load_heldout(**metadata: Any):
    """The bundled model's held-out records as a `test` split."""
    return _jsonl(BUNDLED_HELDOUT_TEXT)


def _jsonl(path: Path):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(path)})
