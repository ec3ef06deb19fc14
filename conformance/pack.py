"""The conformance pack: fixed prompts, their token ids, and fp8kv's log-probabilities per behaviour.

A pack is a folder, written atomically, holding only JSON and safetensors (never pickle):

    PACK/pack.json          `ConformancePack` (prompts with token ids, behaviours, how the model was made)
    PACK/reference.safetensors   one float32 tensor `[len(token_ids) - 1]` per behaviour and prompt,
                                 named "BEHAVIOUR/PROMPT_ID": log p(token i | tokens < i), i >= 1; and
                                 the same with a bf16 cache, "bf16-cache/PROMPT_ID" (no fp8 write at all)
    PACK/model/             the checkpoint the engine under test must load (the source's scales x factor)

An engine's answer is a JSONL file, one line per prompt: {"id": PROMPT_ID, "logprobs": [...]}, the
log-probability of every prompt token after the first (a leading null, as vLLM's prompt_logprobs
gives for the first token, is accepted).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fp8kv.checkpoint.artifacts import check_writable_location, write_file_atomic
from fp8kv.errors import Fp8kvError

PACK_JSON, REFERENCE, MODEL_DIR = "pack.json", "reference.safetensors", "model"
# The log-probabilities with a bf16 cache: an engine's own answers with one measure its arithmetic alone.
BF16_CACHE = "bf16-cache"
FORMAT = 1


@dataclass(frozen=True)
class Prompt:
    """One fixed prompt: its id, text and the token ids the model's tokenizer gives it."""

    id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ConformancePack:
    """What `fp8kv conformance reference` wrote: the prompts and the behaviours it has log-probabilities for.

    `behaviours` starts with "correct" (the write every engine should do), then the bug models;
    `same_as_correct` lists bugs that gave the correct log-probabilities on these prompts (a check
    cannot tell them apart here). `scale_factor` is what the source's scales were multiplied by in
    `model/` (below 1, values cross the fp8 maximum and the clamp is exercised); `separation` is the
    smallest distance between two behaviours, against which an engine's distance to its match is judged.
    `bf16_cache` says the reference also holds `BF16_CACHE` log-probabilities (packs written before it do not).
    """

    source: str
    kv_dtype: str
    scale_factor: float
    prompts: tuple[Prompt, ...]
    behaviours: tuple[str, ...]
    same_as_correct: tuple[str, ...] = ()
    separation: float = 0.0  # the smallest distance between two behaviours' log-probabilities
    bf16_cache: bool = False
    format: int = FORMAT

    @property
    def logprob_counts(self) -> dict[str, int]:
        """Log-probabilities per prompt id: one for every token after the first."""
        return {p.id: len(p.token_ids) - 1 for p in self.prompts}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> ConformancePack:
        try:
            data = json.loads(text)
            prompts = tuple(Prompt(p["id"], p["text"], tuple(int(t) for t in p["token_ids"])) for p in data.pop("prompts"))
            pack = cls(**{**data, "prompts": prompts, "behaviours": tuple(data["behaviours"]),
                          "same_as_correct": tuple(data.get("same_as_correct", ()))})
        except (ValueError, KeyError, TypeError) as exc:
            raise Fp8kvError(f"{where}: not a conformance pack ({exc}); write one with fp8kv conformance reference") \
                from None
        if pack.format != FORMAT:
            raise Fp8kvError(f"{where}: pack format {pack.format}, this fp8kv reads {FORMAT}; rewrite the pack")
        return pack


def check_pack_location(out: Path) -> None:
    """`out` can take a pack: nothing there but an older pack, and a folder beside it this process may write."""
    if out.exists() and not (out / PACK_JSON).is_file():
        raise Fp8kvError(f"{out}: exists and is not a conformance pack; choose another --out")
    check_writable_location(out)


def write_pack(out: Path, pack: ConformancePack, logprobs: dict[str, dict[str, torch.Tensor]],
               write_model: Callable[[Path], object]) -> Path:
    """Write the pack to `out` atomically: a temp folder beside it, renamed into place.

    `logprobs[behaviour][prompt_id]` are float32 `[len(token_ids) - 1]`; `write_model(folder)` writes the
    checkpoint into `folder`.
    """
    out = Path(out)
    check_pack_location(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.fp8kv-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_model(tmp / MODEL_DIR)
        tensors = {f"{name}/{pid}": t.float().contiguous() for name, rows in logprobs.items() for pid, t in rows.items()}
        save_file(tensors, str(tmp / REFERENCE), metadata={"format": "pt"})
        (tmp / PACK_JSON).write_text(pack.to_json(), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_pack(folder: Path) -> tuple[ConformancePack, dict[str, dict[str, torch.Tensor]]]:
    """The pack and its reference log-probabilities, `[behaviour][prompt_id]` (and `[BF16_CACHE]` where written)."""
    folder = Path(folder)
    if not (folder / PACK_JSON).is_file() or not (folder / REFERENCE).is_file():
        raise Fp8kvError(f"{folder}: no {PACK_JSON} and {REFERENCE}; write a pack with fp8kv conformance reference")
    pack = ConformancePack.from_json(_read_text(folder / PACK_JSON), str(folder / PACK_JSON))
    reference = folder / REFERENCE
    try:
        tensors = load_file(str(reference))
    except (OSError, SafetensorError) as exc:
        raise Fp8kvError(f"{reference}: not a readable safetensors file ({exc}); write the pack again") from None
    lengths = pack.logprob_counts
    expected = (*pack.behaviours, BF16_CACHE) if pack.bf16_cache else pack.behaviours
    logprobs: dict[str, dict[str, torch.Tensor]] = {name: {} for name in expected}
    for key, tensor in tensors.items():
        name, _, pid = key.partition("/")
        if name in logprobs and pid in lengths and (tensor.dtype != torch.float32 or tensor.shape != (lengths[pid],)):
            raise Fp8kvError(f"{reference}: {key} is {str(tensor.dtype).removeprefix('torch.')} "
                             f"{list(tensor.shape)}; the pack expects float32 [{lengths[pid]}]; write the pack again")
        logprobs.setdefault(name, {})[pid] = tensor
    for name in expected:
        missing = sorted(set(lengths) - set(logprobs[name]))
        if missing:
            raise Fp8kvError(f"{reference}: {name} has no log-probabilities for prompts {missing}")
    return pack, logprobs


def write_answers(path: Path, answers: dict[str, list[float]]) -> None:
    """An engine's answer file: one JSON line per prompt, {"id", "logprobs"} (non-finite values as null)."""
    lines = [json.dumps({"id": pid, "logprobs": [v if math.isfinite(v) else None for v in values]})
             for pid, values in answers.items()]
    write_file_atomic(Path(path), ("\n".join(lines) + "\n").encode())


def read_answers(path: Path, pack: ConformancePack) -> dict[str, torch.Tensor]:
    """An engine's answer file, checked against the pack: float32 `[len(token_ids) - 1]` per prompt id.

    null stands for a NaN/inf log-probability; a leading null for the first token is dropped.
    """
    path = Path(path)
    if not path.is_file():
        problem = "a folder, not a file" if path.is_dir() else "no such file"
        raise Fp8kvError(f"{path}: {problem}; write one line per prompt: {{\"id\": ..., \"logprobs\": [...]}}")
    lengths = pack.logprob_counts
    answers: dict[str, torch.Tensor] = {}
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            pid, values = _answer(line, f"{path}:{number}")
            if pid not in lengths:
                raise Fp8kvError(f"{path}:{number}: prompt id {pid!r} is not in the pack ({', '.join(lengths)})")
            if pid in answers:
                raise Fp8kvError(f"{path}:{number}: a second answer for prompt {pid}")
            if len(values) == lengths[pid] + 1 and values[0] is None:
                values = values[1:]
            if len(values) != lengths[pid]:
                raise Fp8kvError(f"{path}:{number}: prompt {pid} has {len(values)} log-probabilities; the pack "
                                 f"expects {lengths[pid]} (one per token after the first)")
            answers[pid] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
    missing = sorted(set(lengths) - set(answers))
    if missing:
        raise Fp8kvError(f"{path}: no answer for prompts {missing}")
    return answers


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Fp8kvError(f"{path}: cannot be read as UTF-8 text ({exc})") from None


def _answer(line: str, where: str) -> tuple[str, list[Any]]:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise Fp8kvError(f"{where}: not a JSON line ({exc})") from None
    if not isinstance(data, dict) or "id" not in data or not isinstance(data.get("logprobs"), list):
        raise Fp8kvError(f"{where}: not a {{\"id\": ..., \"logprobs\": [...]}} object")
    pid, values = str(data["id"]), data["logprobs"]
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        raise Fp8kvError(f"{where}: logprobs must be numbers or null")
    if any(v is not None and v > 0 for v in values):  # NaN compares False: it stands for a lost token
        raise Fp8kvError(f"{where}: a log-probability above 0 ({max(v for v in values if v is not None):g}); "
                         f"write log p, not p or -log p")
    return pid, values
