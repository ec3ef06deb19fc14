"""Paired comparisons over held-out sequences: the difference of two per-token means, its interval and p-value.

Tokens of one sequence are not independent samples (a sequence that is hard for one cache is hard for the other),
so the unit is the sequence. The test is the sign-flip test: were the true difference `delta`, each sequence's
excess d_i - delta * n_i (d_i: its summed difference, n_i: its tokens) would be as likely negative as positive, so
the statistic with the signs of any subset of sequences flipped is as likely as the one observed. Flipping a
subset S passes the observed statistic exactly when delta >= mean(S) = sum_S d_i / sum_S n_i, so the p-value is a
count of subsets and the interval's ends are order statistics of these subset means.

Unlike a percentile bootstrap, which came out too narrow over 8 sequences, this holds at any number of sequences
when each sequence's difference is symmetric about the common one; its price is that n sequences can never show a
p-value below 2^-n. Every subset is used up to `ENUMERATED` sequences, a seeded draw of `DRAWS` subsets beyond,
so a report is the same on every run.
"""

from __future__ import annotations

import math

import torch

from fp8kv.verify.results import HIGHER_IS_BETTER, PairedDifference

ENUMERATED = 16
DRAWS = 9999
SEED = 0
CONFIDENCE = 0.95


def paired_difference(measure: str, ours: list[float], theirs: list[float], tokens: list[int]) -> PairedDifference:
    """`ours` and `theirs` are one measure summed over each sequence's tokens (`tokens[i]` of them in sequence i);
    the result compares their per-token means: the difference, its interval and the p-value that these scales
    (`ours`) are worse."""
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    n = torch.tensor(tokens, dtype=torch.float64)
    total = float(n.sum())
    means = subset_means(a - b, n)
    difference = float((a.sum() - b.sum()) / total)
    low, high = _interval(means)
    # the identity (no sign flipped) is one of the equally likely statistics and always as extreme as itself
    extreme = int((means >= 0).sum()) if measure in HIGHER_IS_BETTER else int((means <= 0).sum())
    return PairedDifference(measure, float(a.sum()) / total, float(b.sum()) / total, difference, low, high,
                            len(tokens), int(total), (extreme + 1) / (len(means) + 1))


def subset_means(difference: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token mean of `difference` [n] over each nonempty subset of the sequences that hold tokens: all of them
    for up to `ENUMERATED` sequences, else `DRAWS` drawn with a seeded generator; float64 [subsets]."""
    held = tokens > 0  # a sequence with no token predicted differs by nothing and weighs nothing
    difference, tokens = difference[held], tokens[held]
    count = len(tokens)
    if count <= ENUMERATED:
        codes = torch.arange(1, 1 << count)
        members = ((codes[:, None] >> torch.arange(count)) & 1).to(torch.float64)  # [2^n - 1, n]
    else:
        generator = torch.Generator().manual_seed(SEED)
        members = torch.randint(0, 2, (DRAWS, count), generator=generator).to(torch.float64)
        members = members[members.sum(1) > 0]
    return (members @ difference) / (members @ tokens)


def _interval(means: torch.Tensor) -> tuple[float, float]:
    """The `CONFIDENCE` interval from the sorted subset means: a shift is inside unless fewer than a tail's share
    of the equally likely statistics lie beyond the observed one (unbounded when the subsets are too few)."""
    outside = math.floor((1 - CONFIDENCE) / 2 * (len(means) + 1)) - 1  # subset means each tail may leave out
    if outside < 0:
        return -math.inf, math.inf
    ordered = torch.sort(means).values
    return float(ordered[outside]), float(ordered[-outside - 1])
