"""Calibration data: local formats, column detection, chat templates, determinism, padding, fallback."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fp8kv import data as data_module
from fp8kv.data import DataRequest, load_calibration_data, make_batches
from fp8kv.errors import Fp8kvError, UsageError
from fp8kv.tools.factory import make_tokenizer

TEXTS = [f"Record {i}: the quick brown fox jumps over {i} lazy dogs." for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".txt"])
def test_every_local_format_gives_one_sample_per_record(tmp_path, tokenizer, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, [{"text": t} for t in TEXTS])
    elif suffix == ".txt":
        path.write_text("\n\n".join(TEXTS))  # one record per paragraph
    else:
        frame = pd.DataFrame({"text": TEXTS})
        frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    result = load_calibration_data(DataRequest(dataset=str(path), num_samples=12, seq_len=8), tokenizer)
    assert len(result.samples) == 12 and result.text_column == "text" and result.split == "train"
    assert all(1 <= len(s) <= 8 for s in result.samples)
    full = sorted(tokenizer(t)["input_ids"][:8] for t in TEXTS)
    assert sorted(result.samples) == full  # every record once, from its own first token


def test_same_seed_same_samples_other_seed_other_order(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])

    def ask(seed: int) -> list[list[int]]:
        return load_calibration_data(DataRequest(dataset=str(path), num_samples=5, seed=seed), tokenizer).samples

    assert ask(42) == ask(42)
    assert ask(42) != ask(7)


def test_chat_messages_use_the_chat_template(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "id": 1}])
    result = load_calibration_data(DataRequest(dataset=str(path), num_samples=1), tokenizer)
    assert result.text_column == "messages"
    expected = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False))["input_ids"]
    assert result.samples == [expected]


def test_folder_of_files_and_explicit_column(tmp_path, tokenizer):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"body": t} for t in TEXTS[:6]])
    write_jsonl(folder / "b.jsonl", [{"body": t} for t in TEXTS[6:]])
    with pytest.raises(Fp8kvError, match=r"no 'text' or 'messages' column; pass --text-column body$"):
        load_calibration_data(DataRequest(dataset=str(folder), num_samples=2), tokenizer)
    result = load_calibration_data(DataRequest(dataset=str(folder), text_column="body", num_samples=12), tokenizer)
    assert len(result.samples) == 12


def test_too_little_text_says_what_was_found(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS[:3]] + [{"text": "  "}])
    with pytest.raises(Fp8kvError, match=r"found 3 non-empty records \(\d+ tokens\) but --num-samples is 10; lower --num-samples to 3"):
        load_calibration_data(DataRequest(dataset=str(path), num_samples=10), tokenizer)


def test_default_falls_back_to_bundled_corpus_in_one_line(tmp_path, tokenizer, monkeypatch):
    bundled = write_jsonl(tmp_path / "calibration.jsonl", [{"text": t} for t in TEXTS])
    monkeypatch.setattr(data_module, "BUNDLED_CALIBRATION_TEXT", bundled)
    monkeypatch.setattr(data_module, "DEFAULT_DATASET", "fp8kv-tests/no-such-dataset")
    monkeypatch.setattr(data_module, "_hub_reachable", lambda: False)
    result = load_calibration_data(DataRequest(num_samples=4), tokenizer, fallback=True)
    assert result.dataset == str(bundled) and len(result.samples) == 4
    assert result.note is not None and "\n" not in result.note and "bundled" in result.note


def test_without_fallback_an_unloadable_default_is_a_usage_error_naming_dataset(tmp_path, tokenizer, monkeypatch):
    """Any model but the bundled ones: the bundled corpus would be the wrong text, so nothing falls back."""
    monkeypatch.setattr(data_module, "DEFAULT_DATASET", "fp8kv-tests/no-such-dataset")
    monkeypatch.setattr(data_module, "_hub_reachable", lambda: False)
    with pytest.raises(UsageError) as raised:
        load_calibration_data(DataRequest(num_samples=4), tokenizer)
    assert str(raised.value) == (
        "fp8kv-tests/no-such-dataset cannot be loaded (offline and not cached), and the bundled corpus fits only the "
        "bundled models: pass --dataset (a .txt/.jsonl/.parquet file, a Hub dataset org/name, or 'generated' (text "
        "the model writes itself))")


def test_unknown_named_dataset_offline_is_one_clear_error(tokenizer, monkeypatch):
    monkeypatch.setattr(data_module, "_hub_reachable", lambda: False)
    with pytest.raises(Fp8kvError, match=r"dataset 'fp8kv-tests/nothing' split 'train_sft' cannot be loaded \(offline and not cached\)"):
        load_calibration_data(DataRequest(dataset="fp8kv-tests/nothing", num_samples=1), tokenizer)


def test_batches_are_right_padded_longest_first():
    batches = make_batches([[1, 2], [3, 4, 5, 6], [7]], batch_size=2, pad_id=0)
    assert batches[0].input_ids.tolist() == [[3, 4, 5, 6], [1, 2, 0, 0]]
    assert batches[0].attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batches[1].input_ids.tolist() == [[7]]


def test_repeated_prefixes_are_the_longest_each_earlier_sample_begins_with():
    from fp8kv.data import repeated_prefixes

    samples = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 9], [7], [1, 2], []]
    assert repeated_prefixes(samples) == [0, 2, 3, 0, 2, 0]
