"""The arithmetic task fp8kv ships for real models: deterministic, right answers, loadable by lm_eval."""

from __future__ import annotations

import operator
import re

from fp8kv.evaluation.bundled_tasks import ARITHMETIC_ITEMS, TASKS_DIR, arithmetic_items

_QUESTION = re.compile(r"^Question: What is (\d+) (plus|minus|times) (\d+)\?\nAnswer:$")
_OPERATORS = {"plus": operator.add, "minus": operator.sub, "times": operator.mul}


def test_every_item_has_one_right_answer_among_four_distinct_choices() -> None:
    items = arithmetic_items()
    assert items == arithmetic_items() and len(items) == ARITHMETIC_ITEMS
    for item in items:
        a, word, b = _QUESTION.match(item["question"]).groups()
        numbers = [int(choice) for choice in item["choices"]]
        assert len(set(numbers)) == 4 and all(choice.startswith(" ") for choice in item["choices"])
        assert numbers[item["answer"]] == _OPERATORS[word](int(a), int(b))
    answers = [item["answer"] for item in items]
    assert all(answers.count(position) > ARITHMETIC_ITEMS // 5 for position in range(4))  # no position bias


def test_lm_eval_reads_the_shipped_task() -> None:
    from lm_eval.tasks import TaskManager

    # lm_eval's own thousands of tasks are not indexed: the shipped one alone is asked for
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load("fp8kv_arith_mc")["tasks"]["fp8kv_arith_mc"]
    docs = list(task.test_docs())
    assert len(docs) == ARITHMETIC_ITEMS
    assert (task.doc_to_text(docs[0]), task.doc_to_choice(docs[0]), task.doc_to_target(docs[0])) == (
        docs[0]["question"], docs[0]["choices"], docs[0]["answer"])
