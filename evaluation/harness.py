"""The lm-evaluation-harness model `fp8kv`: task scores on fp8kv's paged (fp8) KV cache.

Importing this module registers the model with lm_eval; `python -m fp8kv.evaluation` is lm_eval's
command line with it registered:

    python -m fp8kv.evaluation --model fp8kv --batch_size 8 --tasks gsm8k \\
        --model_args pretrained=DIR,kv_cache=fp8,scales=checkpoint,engine=sglang,device=xla-cpu

Every request runs on `PagedModelRunner`: up to `batch_size` sequences share each step (ragged
prefill for log-likelihoods, batched greedy decode for generation), so the cache quantizes K/V
exactly as it does in `fp8kv verify`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fp8kv.data import load_tokenizer
from fp8kv.engine_models import DEFAULT_ENGINE
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.errors import Fp8kvError
from fp8kv.evaluation.spec import CacheSpec, open_runner
from fp8kv.options import EVAL_EXTRA_HINT
from fp8kv.geometry import read_config
from fp8kv.runtime.runner import PagedModelRunner

try:
    # lm_eval fills its own model table only when the registry is empty, so load it before adding ours.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError:
    raise Fp8kvError(f"lm-evaluation-harness is not installed: {EVAL_EXTRA_HINT}") from None

MODEL_NAME = "fp8kv"
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_LENGTH = 2048  # lm_eval's own default context; a larger one preallocates a larger cache
Request = tuple[Any, list[int], list[int]]  # (cache key, context tokens, continuation tokens)


@register_model(MODEL_NAME)
class Fp8kvLM(TemplateLM):
    """lm_eval model on fp8kv's runtime.

    Args (all lm_eval `--model_args` strings):
        pretrained: checkpoint folder (or `bundled`).
        kv_cache, scales, engine: see `CacheSpec` (bf16 | fp8; checkpoint | unit; an engine model name).
        quantize_query: also read Q as fp8 with the checkpoint's q_scale (fp8 attention).
        device: auto, tpu, xla-cpu, cuda (or cuda:N) or cpu, as for `fp8kv verify`.
        batch_size: sequences per runner step (lm_eval's `--batch_size`; "auto" means 8).
        max_length: longest sequence (default: the model's, at most 2048).
        max_gen_toks: default generation budget when a task sets none.
        add_bos_token: start every context with the tokenizer's BOS token (default: when it has one).
        model: preloaded weights from `fp8kv.runtime.runner.load_model`, shared between caches (Python only).
    """

    def __init__(self, pretrained: str, kv_cache: str = "fp8", scales: str = "checkpoint", engine: str = DEFAULT_ENGINE,
                 quantize_query: bool = False, device: str | None = None, batch_size: int | str | None = None, max_batch_size: int | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, page_size: int = 16,
                 add_bos_token: bool | None = None, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model_dir = resolve_model(str(pretrained))
        self.spec = CacheSpec.parse(str(kv_cache), str(scales), str(engine), bool(quantize_query))
        self.tokenizer = load_tokenizer(self.model_dir, False)
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(max_length or min(_model_context(self.model_dir), DEFAULT_MAX_LENGTH))
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = self.tokenizer.bos_token_id is not None if add_bos_token is None else bool(add_bos_token)
        self.runner: PagedModelRunner = open_runner(
            self.model_dir, self.spec, device=_device_choice(device), max_model_len=self.max_length,
            max_num_seqs=self.batch_size, page_size=int(page_size), model=model,
        )
        self._device = self.runner.device

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> Fp8kvLM:
        """lm_eval's constructor path; `--model_args` win over its global options (its `--device` defaults to cuda:0)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> Fp8kvLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and the first rolling window) is conditioned on: BOS when there is one."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.model_dir).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = list(self.tokenizer(string, add_special_tokens=False)["input_ids"])
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_bos and self.tokenizer.bos_token_id is not None and ids[:1] != [self.tokenizer.bos_token_id]:
            ids.insert(0, self.tokenizer.bos_token_id)
        return ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether it is the greedy continuation, per request."""
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        for chunk in _chunks(order, self.batch_size):
            # The last max_length tokens before the final one; the last len(continuation) rows score it.
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            for i, rows in zip(chunk, self._prefill(inputs)):
                key, _, continuation = requests[i]
                if not continuation:  # nothing to score: log 1, and trivially greedy
                    results[i] = (0.0, True)
                    continue
                target = torch.tensor(continuation)
                logp = torch.log_softmax(rows[-len(continuation):], dim=-1)  # [len(continuation), vocab]
                score = float(logp.gather(1, target[:, None]).double().sum())
                results[i] = (score, bool((logp.argmax(-1) == target).all()))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents in disjoint windows of at most max_length tokens, each predicted once."""
        windows: list[Request] = []
        owner: list[int] = []
        for n, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(token_list=self.tok_encode(text, add_special_tokens=False),
                                                prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                                                context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, `batch_size` prompts decoded together, each cut at its first stop string."""
        jobs = [_GenerationJob.of(req.args, self) for req in requests]
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i].prompt))
        for chunk in _chunks(order, self.batch_size):
            self._decode([jobs[i] for i in chunk])
        for req, job in zip(requests, jobs):
            self.cache_hook.add_partial("generate_until", req.args, job.text)
        return [job.text for job in jobs]

    def _prefill(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        seqs = [self.runner.start()[0] for _ in inputs]
        try:
            return self.runner.step(list(zip(seqs, inputs)))
        finally:
            for seq in seqs:
                self.runner.free(seq)

    def _decode(self, jobs: list[_GenerationJob]) -> None:
        seqs = [self.runner.start()[0] for _ in jobs]
        try:
            logits = self.runner.step(list(zip(seqs, [job.prompt for job in jobs])))
            active = list(range(len(jobs)))
            while active:
                for j, rows in zip(active, logits):
                    jobs[j].take(int(rows[-1].argmax()), self)
                active = [j for j in active if not jobs[j].done]
                if active:
                    logits = self.runner.step([(seqs[j], jobs[j].tokens[-1:]) for j in active])
        finally:
            for seq in seqs:
                self.runner.free(seq)


class _GenerationJob:
    """One generate_until request: its prompt, stop strings, budget and what was generated so far."""

    def __init__(self, prompt: list[int], until: list[str], budget: int) -> None:
        self.prompt, self.until, self.budget = prompt, until, budget
        self.tokens: list[int] = []
        self.text = ""
        self.done = False

    @classmethod
    def of(cls, args: tuple[str, dict[str, Any]], lm: Fp8kvLM) -> _GenerationJob:
        context, kwargs = args
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
            raise Fp8kvError("the fp8kv model decodes greedily; set do_sample=false and temperature=0")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        budget = int(kwargs.get("max_gen_toks") or lm.max_gen_toks)
        if budget >= lm.max_length:
            raise Fp8kvError(f"max_gen_toks={budget} leaves no room for a prompt within max_length={lm.max_length}")
        return cls(lm.tok_encode(context)[-(lm.max_length - budget):], until, budget)

    def take(self, token: int, lm: Fp8kvLM) -> None:
        """Append one greedy token; stop at EOS, at a stop string (cut there) or at the budget."""
        self.tokens.append(token)
        self.text = lm.tok_decode(self.tokens)
        cuts = [self.text.index(stop) for stop in self.until if stop and stop in self.text]
        if cuts:
            self.text = self.text[: min(cuts)]
        self.done = bool(cuts) or token == lm.eot_token_id or len(self.tokens) >= self.budget


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _batch_size(value: int | str | None) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    size = int(value)
    if size < 1:
        raise Fp8kvError(f"batch_size must be at least 1, got {size}")
    return size


def _device_choice(device: str | None) -> str:
    """lm_eval's `--device` (None, cuda:0, ...) as a runtime device choice."""
    if device is None:
        return "auto"
    return "cuda" if str(device).startswith("cuda") else str(device)


def _model_context(model_dir: Path) -> int:
    config = read_config(model_dir)
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)
