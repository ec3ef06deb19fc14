"""Train the bundled default model: a small Llama on Python's own documentation.

    python -m fp8kv.tools.train            # rewrites models/bundled/ (~11 min, 2 busy cores)
    python -m fp8kv.tools.train --out /tmp/m --steps 20   # smoke run

The corpus ships with CPython (PSF license), so training needs no download: the language and
library reference topics of `pydoc_data.topics` plus the module, class and function docstrings
of the top-level standard-library sources (read with `ast`, never imported). Documents are
taken in sorted order and cut into records of at most `RECORD_CHARS` characters; every 20th
record is held out and every 20th (offset 10) is kept for calibration, neither ever trained on.
Everything is seeded, and the data order is a seeded permutation, so a rerun with the same
Python and torch versions rebuilds the same model.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8kv.models import BUNDLED_DIR
from fp8kv.tools.factory import train_tokenizer

RECORD_CHARS = 900
MIN_SPLIT_CHARS = 300  # calibration / held-out records are at least this long
MIN_DOCSTRING_CHARS = 200
VOCAB_SIZE = 2048
SEQ_LEN = 320
BATCH_SIZE = 4
LEARNING_RATE = 2e-3
PROMPT = "The for statement is used to"


@dataclass(frozen=True)
class Splits:
    """The corpus cut into records: train, calibration and held-out never overlap."""

    train: list[str]
    calibration: list[str]
    heldout: list[str]


def corpus_documents() -> list[str]:
    """Python's documentation topics, then stdlib docstrings, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    documents = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py")):
        documents.extend(_docstrings(source))
    return documents


def _docstrings(source: Path) -> list[str]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [text for text in found if text and len(text) >= MIN_DOCSTRING_CHARS]


def records(document: str, max_chars: int = RECORD_CHARS) -> Iterator[str]:
    """Pack whole lines of `document` into records of at most `max_chars` characters."""
    current = ""
    for line in document.strip().splitlines(keepends=True):
        while len(line) > max_chars:  # a single overlong line is cut hard
            if current:
                yield current.strip()
                current = ""
            yield line[:max_chars]
            line = line[max_chars:]
        if len(current) + len(line) > max_chars:
            yield current.strip()
            current = ""
        current += line
    if current.strip():
        yield current.strip()


def split_corpus(documents: list[str]) -> Splits:
    """Every 20th record (long enough) is held out, every 20th at offset 10 is calibration."""
    splits = Splits([], [], [])
    all_records = [record for document in documents for record in records(document)]
    for index, record in enumerate(all_records):
        long_enough = len(record) >= MIN_SPLIT_CHARS
        if index % 20 == 0 and long_enough:
            splits.heldout.append(record)
        elif index % 20 == 10 and long_enough:
            splits.calibration.append(record)
        else:
            splits.train.append(record)
    return splits


def make_model(tokenizer) -> torch.nn.Module:
    """A 4-layer Llama with GQA (8 query heads, 2 KV heads, head_dim 32), tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def token_windows(texts: list[str], tokenizer, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """The texts as one bos-separated token stream, cut into windows. Returns [n, seq_len + 1]."""
    stream: list[int] = []
    for text in texts:
        stream.append(tokenizer.bos_token_id)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    usable = len(stream) // (seq_len + 1) * (seq_len + 1)
    return torch.tensor(stream[:usable]).view(-1, seq_len + 1)


def train(model: torch.nn.Module, windows: torch.Tensor, steps: int, seed: int) -> None:
    """AdamW with warmup and cosine decay; batches follow a seeded permutation per epoch."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1
    )
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, steps) / steps))),
    )
    batches = _batches(windows, seed)
    model.train()
    progress = tqdm(range(steps), desc="train", unit="step")
    for _ in progress:
        batch = next(batches)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def _batches(windows: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=generator)
        for start in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            yield windows[order[start : start + BATCH_SIZE]]


@torch.no_grad()
def perplexity(model: torch.nn.Module, tokenizer, texts: list[str]) -> float:
    """Token-level perplexity of `model` on `texts`, each scored on its own (bos-prefixed)."""
    total_nll, total_tokens = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)  # [1, T]
        logits = model(input_ids=ids).logits.float()  # [1, T, vocab]
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_tokens += ids.shape[1] - 1
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def continue_text(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int = 60) -> str:
    """Greedy continuation of `prompt`."""
    ids = tokenizer(tokenizer.bos_token + prompt, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def write_bundle(out: Path, model: torch.nn.Module, tokenizer, splits: Splits) -> None:
    """Write model/ (bf16 safetensors, tokenizer) and data/*.jsonl, replacing `out` atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.to(torch.bfloat16).save_pretrained(staging / "model")
    tokenizer.save_pretrained(staging / "model")
    (staging / "data").mkdir()
    for name, texts in (("calibration", splits.calibration), ("heldout", splits.heldout)):
        lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
        (staging / "data" / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    for path in (staging, *staging.rglob("*")):  # mkdtemp and safetensors create owner-only modes
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        retired = out.with_name(f".{out.name}.old")
        out.rename(retired)
        staging.rename(out)
        shutil.rmtree(retired)
    else:
        staging.rename(out)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(
        prog="python -m fp8kv.tools.train", description="Train fp8kv's bundled default model."
    )
    parser.add_argument("--out", type=Path, default=BUNDLED_DIR, help="bundle (model/, data/)")
    parser.add_argument(
        "--steps", type=int, default=3000, help=f"optimizer steps of {BATCH_SIZE} x {SEQ_LEN} tokens"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    splits = split_corpus(corpus_documents())
    tokenizer = train_tokenizer(splits.train, VOCAB_SIZE)
    windows = token_windows(splits.train, tokenizer)
    print(
        f"records: train {len(splits.train)}, calibration {len(splits.calibration)}, "
        f"held-out {len(splits.heldout)}; train tokens {windows.numel()}"
    )
    model = make_model(tokenizer)
    train(model, windows, args.steps, args.seed)
    write_bundle(args.out, model, tokenizer, splits)
    elapsed = time.perf_counter() - started

    # Score what ships: the bf16 weights as read back from disk.
    shipped = AutoModelForCausalLM.from_pretrained(args.out / "model", dtype=torch.float32).eval()
    shipped_tokenizer = AutoTokenizer.from_pretrained(args.out / "model")
    ppl = perplexity(shipped, shipped_tokenizer, splits.heldout)
    print(f"trained in {elapsed:.0f} s; wrote {args.out}")
    vocab, records = len(shipped_tokenizer), len(splits.heldout)
    print(f"held-out perplexity {ppl:.2f} (vocab {vocab}, {records} records)")
    continuation = continue_text(shipped, shipped_tokenizer, PROMPT)
    print(f"greedy continuation of {PROMPT!r}:\n{PROMPT}{continuation}")


if __name__ == "__main__":
    main()
