"""Is verify's reference the model? Its bf16-cache runtime against transformers' own forward.

verify judges the fp8 cache against the runtime's bf16 cache; that only says something about the
model if the bf16 runtime reproduces transformers on it. A few held-out samples run through the
runtime's bf16 cache, packed into one step as verify runs them, and through transformers' forward
on the same weights with its default attention, one sequence per forward. The mean KL(transformers
|| runtime) per token must stay under a bound, else verify refuses to judge.

The bound scales with the model's own rounding noise: transformers against itself with another
attention implementation (eager vs SDPA, same weights and dtype). On trained bf16 weights that
noise is far from zero (the bundled model: 2.6e-4, while the runtime is at 1.7e-4), on tiny random
weights it is near 1e-7; `MIN_BOUND` covers the latter. A model with a single attention implementation
(Gemma 2: eager only) has no such noise to measure: its KL is reported against `MIN_BOUND` as a warning.
"""

from __future__ import annotations


import torch

from fp8kv.runtime.runner import PagedModelRunner, transformers_attention
from fp8kv.verify.accuracy import prefill, token_kl
from fp8kv.verify.results import Fidelity

# Measured (bench/bench_fidelity.py, 4 samples of 256 tokens): runtime / noise 0.66 on the bundled
# model and 0.8 to 1.0 on the factory architectures with bf16 weights, whose runtime KL is at most
# 1.4e-6; with float32 weights the noise is ~1e-9 but the bf16 cache's rounding of K/V gives up to
# 1.4e-7, which MIN_BOUND covers 14x. Runtimes that miss a feature of a tiny model sit above it:
# llama4 chunked attention ignored 1.2e-3, phimoe's window applied only in the mask 5.6e-5,
# linear-attention state leaking between packed sequences 9.8e-6 (minimax, noise 5e-8, before hybrids ran
# one sequence per forward). A larger
# random llama (8 layers, hidden 1024, vocab 32k, bf16) is at 2.8e-6 with eager-vs-SDPA noise of
# 6e-10: the bf16 rounding of a wider model, not a bug, so the floor sits above it.
NOISE_FACTOR = 4.0
MIN_BOUND = 5e-6
NUM_SAMPLES = 2


def measure_fidelity(runner: PagedModelRunner, samples: list[list[int]], num_samples: int = NUM_SAMPLES) -> Fidelity:
    """Compare `runner`'s logits (a bf16 cache) on the first `num_samples` samples with transformers' forward."""
    batch = samples[: min(num_samples, runner.max_num_seqs)]
    runtime = prefill(runner, batch)
    default = runner.model._check_and_adjust_attn_implementation(None)
    reference = transformers_logits(runner.model, batch, default)
    kl, noise = _kl(reference, runtime), _noise(runner.model, batch, reference, default)
    bound = max(MIN_BOUND, NOISE_FACTOR * noise) if noise is not None else MIN_BOUND
    return Fidelity(float(kl.mean()), float(kl.max()), noise, bound, len(batch), int(kl.numel()))


def _noise(model: torch.nn.Module, batch: list[list[int]], reference: list[torch.Tensor], default: str) -> float | None:
    """Mean KL of transformers' default attention against its other one (eager / SDPA); None if it has one."""
    other = "sdpa" if default == "eager" else "eager"
    if not model._can_set_attn_implementation():  # its own attention code: it keeps the one it was loaded with
        return None
    try:
        return float(_kl(reference, transformers_logits(model, batch, other)).mean())
    except ValueError:  # transformers refuses an implementation the architecture does not support
        return None


def _kl(reference: list[torch.Tensor], others: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([token_kl(torch.log_softmax(a, -1), torch.log_softmax(b, -1)) for a, b in zip(reference, others)])


@torch.no_grad()
def transformers_logits(model: torch.nn.Module, samples: list[list[int]], attention: str) -> list[torch.Tensor]:
    """float32 CPU logits `[L, vocab]` of each sample, one sequence per forward, with transformers' `attention`.

    The runners' shared model is switched to `attention` for these forwards and back after.
    """
    device = next(model.parameters()).device
    with transformers_attention(model, attention):
        return [model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()
                for ids in samples]
