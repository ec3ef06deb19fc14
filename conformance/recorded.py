"""A released engine's recorded prompt log-probabilities, and fp8kv's runtime scored the same way on the same ids.

A recorded run is `{"meta": {...}, "prompts": [{"ids", "logprob", "top5_ids", "top5_logprob"}]}`: per prompt, for
each position after the first, the log-probability of the prompt's own token there and the engine's five most
likely tokens (vLLM's `prompt_logprobs`). Token ids are one `{"ids": [...]}` per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from fp8kv.engine_models import engine_model
from fp8kv.runtime.attention import AttentionNumerics
from fp8kv.runtime.runner import PagedModelRunner

BATCH = 8  # prompts prefilled together


@dataclass(frozen=True)
class PromptScores:
    """Per prompt, for each position after the first: the log-probability of the prompt's own token there, and
    the most likely token."""

    logprob: list[torch.Tensor]
    top1: list[torch.Tensor]

    @classmethod
    def read(cls, path: Path) -> PromptScores:
        prompts = json.loads(Path(path).read_text())["prompts"]
        return cls([torch.tensor(p["logprob"]) for p in prompts],
                   [torch.tensor([top[0] for top in p["top5_ids"]]) for p in prompts])

    def gaps(self, other: PromptScores) -> torch.Tensor:
        """|this log-probability - the other's| of every scored token, float32 `[tokens]`."""
        return torch.cat([(a - b).abs() for a, b in zip(self.logprob, other.logprob)])

    def agreeing(self, reference: PromptScores) -> list[int]:
        """Per prompt, the positions whose most likely token is the reference's."""
        return [int((a == b).sum()) for a, b in zip(self.top1, reference.top1)]

    @property
    def positions(self) -> list[int]:
        return [len(top) for top in self.top1]

    def past(self, repeated: list[int]) -> PromptScores:
        """Each prompt's positions from `repeated[i]` on: the ones no earlier prompt scored with the same tokens before
        them (`data.repeated_prefixes`)."""
        return PromptScores([lp[n:] for lp, n in zip(self.logprob, repeated)],
                            [top[n:] for top, n in zip(self.top1, repeated)])


def read_ids(path: Path) -> list[list[int]]:
    """The token ids of each prompt, one JSON object per line."""
    return [json.loads(line)["ids"] for line in Path(path).read_text().splitlines() if line.strip()]


def read_scales(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """The per-layer K and V scales of a compressed-tensors scales file (`model.layers.N.self_attn.k_scale`)."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    pick = lambda kind: {int(name.split(".")[2]): float(t) for name, t in tensors.items() if name.endswith(kind)}  # noqa: E731
    return pick("k_scale"), pick("v_scale")


def recorded_runs(folder: Path, model: str, path: str, dtype: str) -> dict[str, Path]:
    """A probe's recorded runs of one model, hardware path and model dtype, by run name: `folder`'s
    MODEL-PATH-DTYPE-RUN.json files."""
    prefix = f"{model}-{path}-{dtype}-"
    return {p.stem.removeprefix(prefix): p for p in sorted(Path(folder).glob(f"{prefix}*.json"))}


def recorded_paths(folder: Path, models: Iterable[str]) -> list[tuple[str, str, str]]:
    """Every (model, hardware path, model dtype) of `models` with a run recorded in `folder`."""
    found = set()
    for model in models:
        for run in Path(folder).glob(f"{model}-*-*-*.json"):
            _, path, dtype = run.name.split("-")[:3]
            found.add((model, path, dtype))
    return sorted(found)


def plain_cache(model_dtype: str) -> str:
    """The runtime's cache for what an engine keeps under `kv_cache_dtype="auto"`: the model's own dtype (a float32
    model's cache is float32, where fp8kv's reference is bf16)."""
    return "fp32" if model_dtype == "float32" else "bf16"


def served_scales(run: Path, scales: Path) -> tuple[dict[int, float], dict[int, float]] | None:
    """The scales a recorded run's engine served: those of `scales` (a pack's scales file) over the run's
    `meta.scale_divisor`; None where the engine ran its own 1.0."""
    divisor = json.loads(Path(run).read_text())["meta"]["scale_divisor"]
    if divisor is None:
        return None
    k, v = read_scales(scales)
    return {i: s / divisor for i, s in k.items()}, {i: s / divisor for i, s in v.items()}


def nudge(weights: torch.nn.Module, steps: float = 1.0) -> None:
    """Move a decoder's function by `steps` roundings of its dtype, in place: layer 0's input-norm weights times
    1 + steps x eps. Where an fp8 cache amplifies roundings over the layers, how far the nudged model's runs lie from
    the model's own is the spread two implementations' runs can lie apart."""
    norm = weights.get_parameter("model.layers.0.input_layernorm.weight")
    with torch.no_grad():
        norm.mul_(1 + steps * torch.finfo(norm.dtype).eps)


def engine_scores(model_dir: Path, weights: torch.nn.Module, prompts: list[list[int]], engine: str, cache: str,
                  numerics: AttentionNumerics, scales: tuple[dict[int, float], dict[int, float]] | None) -> PromptScores:
    """fp8kv's scores of `prompts` on `weights` with `engine`'s write, attention `numerics` and `scales` (None: the
    engine at scale 1.0)."""
    k, v = scales or (None, None)
    runner = PagedModelRunner(model_dir, device="cpu", cache_dtype=cache, k_scales=k, v_scales=v,
                              engine=engine_model(engine), max_model_len=max(map(len, prompts)), max_num_seqs=BATCH,
                              model=weights, attention_numerics=numerics)
    return score(runner, prompts)


def score(runner: PagedModelRunner, prompts: list[list[int]]) -> PromptScores:
    """`runner`'s scores of `prompts`, as the engine records them: each prompt prefilled, position i predicting
    token i + 1."""
    from fp8kv.verify.accuracy import prefill

    logprob, top1 = [], []
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start : start + BATCH]
        for ids, logits in zip(batch, prefill(runner, batch)):
            logp = torch.log_softmax(logits.float(), -1)[:-1]
            logprob.append(logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
            top1.append(logp.argmax(-1))
    return PromptScores(logprob, top1)
