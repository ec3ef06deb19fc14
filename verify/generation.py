"""Greedy generation on the fp8 cache against the bf16 cache, token by token.

Three phases per prompt, all prompts batched in each step:
- prefill: the next-token argmax at every prompt position;
- decode: `new_tokens` single-token steps, both caches fed the bf16 cache's greedy tokens
  (teacher forcing, so one early difference does not make every later comparison meaningless);
- prefix: a second request that shares the first one's cached prompt pages (whole pages) and
  feeds the rest of the same text; its argmax at every new position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8kv.errors import Fp8kvError
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify.results import GenerationDetails, GenerationMatch


def read_prompts(path: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of each non-empty line of a text file."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError:
        raise Fp8kvError(f"{path}: not UTF-8 text; give one prompt per line") from None
    prompts = [list(tokenizer(line)["input_ids"]) for line in lines if line]
    if not prompts:
        raise Fp8kvError(f"{path}: no prompts; give one prompt per line")
    return prompts


def compare_generation(ref: PagedModelRunner, fp8: PagedModelRunner, prompts: list[list[int]],
                       new_tokens: int) -> tuple[GenerationMatch, GenerationDetails]:
    """Prefill, decode and shared-prefix agreement of `fp8` with `ref`, each a share of positions."""
    seqs = {name: [runner.start()[0] for _ in prompts] for name, runner in (("ref", ref), ("fp8", fp8))}
    matches = {"prefill": [0, 0], "decode": [0, 0], "prefix": [0, 0]}
    pre_ref = ref.step(list(zip(seqs["ref"], prompts)))
    pre_fp8 = fp8.step(list(zip(seqs["fp8"], prompts)))
    for a, b in zip(pre_ref, pre_fp8):
        _count(matches["prefill"], a.argmax(-1).tolist(), b.argmax(-1).tolist())
    fed = [[int(rows[-1].argmax())] for rows in pre_ref]  # greedy tokens of the bf16 cache
    for _ in range(new_tokens):
        out_ref = ref.step([(s, toks[-1:]) for s, toks in zip(seqs["ref"], fed)])
        out_fp8 = fp8.step([(s, toks[-1:]) for s, toks in zip(seqs["fp8"], fed)])
        for toks, a, b in zip(fed, out_ref, out_fp8):
            _count(matches["decode"], [int(a[-1].argmax())], [int(b[-1].argmax())])
            toks.append(int(a[-1].argmax()))
    texts = [p + toks[:-1] for p, toks in zip(prompts, fed)]  # what each first request has cached
    shared = _prefix_requests(ref, fp8, seqs, prompts, texts, matches["prefix"])
    for name, runner in (("ref", ref), ("fp8", fp8)):
        for seq in seqs[name]:
            runner.free(seq)
    share = {phase: hits / total if total else None for phase, (hits, total) in matches.items()}
    return (GenerationMatch(share["prefill"], share["decode"], share["prefix"]),
            GenerationDetails(len(prompts), new_tokens, shared, tuple(tuple(toks[:-1]) for toks in fed)))


def _prefix_requests(ref: PagedModelRunner, fp8: PagedModelRunner, seqs: dict[str, list[int]],
                     prompts: list[list[int]], texts: list[list[int]], counter: list[int]) -> int:
    """Second requests sharing each prompt's cached pages; returns the tokens read from shared pages."""
    outputs, shared = {}, 0
    for name, runner in (("ref", ref), ("fp8", fp8)):
        batch = []
        for first, prompt, text in zip(seqs[name], prompts, texts):
            second, reused = runner.start(share_from=first, shared_tokens=len(prompt))
            batch.append((second, text[reused:]))
            shared += reused if name == "fp8" else 0
        outputs[name] = runner.step(batch)
        for second, _ in batch:
            runner.free(second)
    for a, b in zip(outputs["ref"], outputs["fp8"]):
        _count(counter, a.argmax(-1).tolist(), b.argmax(-1).tolist())
    return shared


def _count(counter: list[int], a: list[int], b: list[int]) -> None:
    counter[0] += sum(x == y for x, y in zip(a, b))
    counter[1] += len(a)
