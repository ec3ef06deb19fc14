"""Paired comparisons over held-out sequences: the difference of two per-token means and a bootstrap interval.

Tokens of one sequence are not independent samples (a sequence that is hard for one cache is hard for the
other), so the resampled unit is the sequence: each resample draws sequences with replacement and recomputes
both means over the tokens they hold. The generator is seeded, so a report is the same on every run.
"""

from __future__ import annotations

import torch

from fp8kv.verify.results import PairedDifference

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95


def paired_difference(measure: str, ours: list[float], theirs: list[float], tokens: list[int]) -> PairedDifference:
    """`ours` and `theirs` are one measure summed over each sequence's tokens (`tokens[i]` of them in sequence i);
    the result compares their per-token means."""
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    n = torch.tensor(tokens, dtype=torch.float64)
    total = float(n.sum())
    difference = float((a.sum() - b.sum()) / total)
    generator = torch.Generator().manual_seed(SEED)
    pick = torch.randint(len(tokens), (RESAMPLES, len(tokens)), generator=generator)
    resampled = (a[pick].sum(1) - b[pick].sum(1)) / n[pick].sum(1)
    tail = (1 - CONFIDENCE) / 2
    low, high = torch.quantile(resampled, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return PairedDifference(measure, float(a.sum()) / total, float(b.sum()) / total, difference, low, high,
                            len(tokens), int(total))
