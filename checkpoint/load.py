"""Load a checkpoint's causal LM with transformers, refusing weights it had to invent or ignore.

transformers fills a weight the files lack with random values (a checkpoint whose config says
`tie_word_embeddings: false` but ships no `lm_head.weight` gets a random head) and drops tensors
it has no place for, with only a log line. Either makes every number measured on the model wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8kv.checkpoint.conventions import parse_scale_name, weights_config
from fp8kv.errors import Fp8kvError

_SHOWN = 5


class WeightsMismatch(Fp8kvError):
    """The weight files do not match the model config.json describes (missing, unexpected or misshapen)."""


def load_causal_lm(model_dir: str | Path, model_class: Any = None, **kwargs: Any) -> Any:
    """`model_class.from_pretrained(model_dir, **kwargs)` (default `AutoModelForCausalLM`) on the weights'
    config (`weights_config`); `WeightsMismatch` naming the tensors transformers reports missing,
    unexpected or of the wrong shape (K/V/Q scales are read by fp8kv itself).
    """
    from transformers import AutoModelForCausalLM

    config = weights_config(model_dir, kwargs.get("trust_remote_code", False))
    model_class = model_class or AutoModelForCausalLM
    model, info = model_class.from_pretrained(model_dir, config=config, output_loading_info=True, **kwargs)
    problems = [
        _named("missing (randomly initialized)", info.get("missing_keys") or ()),
        _named("unexpected (ignored)", [k for k in info.get("unexpected_keys") or () if parse_scale_name(k) is None]),
        _named("of the wrong shape", [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()]),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise WeightsMismatch(f"{model_dir}: the weight files do not match config.json: {'; '.join(problems)}")
    return model


def _named(what: str, keys: Any) -> str:
    names = sorted(str(k) for k in keys)
    if not names:
        return ""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{len(names)} weight(s) {what}: {', '.join(names[:_SHOWN])}{more}"
