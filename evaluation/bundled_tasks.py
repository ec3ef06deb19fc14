"""lm_eval tasks fp8kv ships for its bundled model (CPython documentation), readable offline.

`TASKS_DIR` is an lm_eval include path: `fp8kv_pydoc_mc` (multiple choice), `fp8kv_pydoc_gen`
(the same questions, generated) and `fp8kv_pydoc_ppl` (rolling log-likelihood of the held-out split);
and for real models, `fp8kv_arith_mc`: short arithmetic questions, four numeric choices each,
generated from a seed (no file), that a small instruct model answers well above chance (25 %).
"""

from __future__ import annotations

import random
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


ARITHMETIC_ITEMS = 300
ARITHMETIC_SEED = 0
# (question wording, the two operand ranges, the operation)
_OPERATIONS = (("plus", (2, 30), (2, 30), lambda a, b: a + b),
               ("minus", (10, 40), (1, 9), lambda a, b: a - b),
               ("times", (2, 9), (2, 9), lambda a, b: a * b))


def arithmetic_items(count: int = ARITHMETIC_ITEMS, seed: int = ARITHMETIC_SEED) -> list[dict[str, Any]]:
    """`count` questions "What is A plus B?" (plus, minus, times in turn), each with the answer and three wrong
    numbers near it (off by 1, 2 or 10) as choices in a seeded order; `answer` indexes the right one."""
    rng = random.Random(seed)
    items = []
    for i in range(count):
        word, left, right, operation = _OPERATIONS[i % len(_OPERATIONS)]
        a, b = rng.randint(*left), rng.randint(*right)
        answer = operation(a, b)
        wrong = [answer + d for d in rng.sample((-10, -2, -1, 1, 2, 10), 6) if answer + d >= 0][:3]
        choices = [answer, *wrong]
        rng.shuffle(choices)
        items.append({"question": f"Question: What is {a} {word} {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
                      "answer": choices.index(answer)})
    return items


def load_arithmetic(**metadata: Any):
    """`arithmetic_items()` as a `test` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(arithmetic_items())})


def _jsonl(path: Path):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(path)})
