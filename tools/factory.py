"""Tiny random-weight Hugging Face checkpoints for tests and benchmarks.

Each checkpoint is a real architecture with a real (small, trained) BPE tokenizer and real
safetensors files, written in well under a second:

    from fp8kv.tools.factory import make_checkpoint
    path = make_checkpoint("qwen3", tmp_path / "qwen3", num_layers=2)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")  # experts stored one per tensor, merged by transformers on load
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *MOE_ARCHITECTURES)

# A minimal chat template, so `messages` datasets work with factory tokenizers.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def make_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = 16,
    max_shard_bytes: int | None = None,
    seed: int = 0,
    tokenizer_vocab: int = 512,
) -> Path:
    """Write a random-weight checkpoint of `arch` with a BPE tokenizer into `out_dir`.

    `vocab_size` defaults to the tokenizer's size; a larger one pads the embedding table
    (as real models do). `max_shard_bytes` splits the weights into several safetensors
    files with a `model.safetensors.index.json`. Returns `out_dir`.
    """
    from transformers import AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(tokenizer_vocab)
    config = make_config(
        arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * hidden_size,
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        sliding_window=sliding_window,
        tokenizer=tokenizer,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _spread_norm_weights(model)
    save_kwargs: dict[str, Any] = {}
    if max_shard_bytes is not None:
        save_kwargs["max_shard_size"] = max_shard_bytes
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return out


def make_config(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    intermediate_size: int,
    vocab_size: int,
    sliding_window: int | None,
    tokenizer: Any,
):
    """The transformers config of a tiny `arch` model."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch != "phi3":  # phi3 derives head_dim from hidden_size; others default to 128 or 256
        common["head_dim"] = head_dim or hidden_size // num_heads
    window = {"sliding_window": sliding_window} if sliding_window else {}
    extra: dict[str, dict[str, Any]] = {
        "llama": {},
        "mistral": window,
        "qwen2": {},
        "qwen3": {},
        "gemma2": {**window, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 32},
        "gemma3_text": {**window, "query_pre_attn_scalar": 32},
        "phi3": window,
        # mixture of experts: 4 small experts, 2 routed per token, in every layer
        "mixtral": {**window, "num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": intermediate_size // 2},
    }
    model_type = "gemma3_text" if arch == "gemma3" else arch
    return AutoConfig.for_model(model_type, **common, **extra[model_type])


def _spread_norm_weights(model: torch.nn.Module) -> None:
    """Give RMSNorm weights (and q/k norms) a spread, so K and V differ across heads and layers.

    Freshly initialised norms are all ones (or zeros for Gemma's 1+w form), which would make
    every layer's statistics look alike and hide mistakes in per-layer bookkeeping.
    """
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                noise = torch.rand(param.shape, generator=generator) * 1.5 + 0.25
                base = 0.0 if (param == 0).all() else 1.0
                param.copy_((noise - (1.0 - base)).to(param.dtype))


@functools.lru_cache(maxsize=4)
def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on Python's bundled documentation text.

    Python ships its language reference (pydoc_data), so this needs no download and is
    identical on every machine. The result is a `PreTrainedTokenizerFast` with bos/eos/pad
    tokens and a chat template.
    """
    return train_tokenizer(_documentation_text(), vocab_size)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE `PreTrainedTokenizerFast` (bos/eos/pad, chat template) on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _documentation_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]
