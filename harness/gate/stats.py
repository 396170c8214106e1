"""The gate's statistic: a Mann-Whitney U test on per-round values, and the Hodges-Lehmann shift
with its distribution-free (Moses) confidence interval.

Why this and not a bootstrap of the ratio of medians. The unit of independence is the round: one
fresh process, with its own clocks, allocator layout, compiled kernels and neighbours on a shared
GPU. Steps within one process are correlated, so a bootstrap that resamples steps calls a
process-to-process shift "significant" (it cries wolf), and one that resamples rounds has too
few of them to be stable at 5-10 rounds. The U test on one value per round is exact at any
sample size, assumes no distribution, and one slow round moves it by one rank, not by its
magnitude. Its interval is the Hodges-Lehmann estimate's: the same ranks, so "significant at
alpha" and "the 1-alpha interval excludes no change" agree, and a ratio is read off directly by
taking logs (``log_ratio``).

Exact p-values use the permutation distribution of the rank sum, ties included (mid-ranks, counted
by dynamic programming over doubled ranks, so no floating point enters the counts); above
``EXACT_MAX`` values in all, the normal approximation with the tie correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

EXACT_MAX = 60  # values in both samples together, beyond which the normal approximation is used


def _midranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test that ``x`` and ``y`` come from one
    distribution. 1.0 when they cannot be told apart at all (every value tied)."""
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        raise ValueError("the U test needs at least one value on each side")
    ranks = _midranks([*x, *y])
    doubled = [round(2 * r) for r in ranks]  # mid-ranks are multiples of 1/2
    observed = sum(doubled[:n])
    expected = n * (n + m + 1)  # doubled mean rank sum of x under the null
    if n + m <= EXACT_MAX:
        counts = _rank_sum_counts(tuple(sorted(doubled)), n)
        total = sum(counts.values())
        far = abs(observed - expected)
        return min(1.0, sum(c for s, c in counts.items() if abs(s - expected) >= far) / total)
    # normal approximation, tie-corrected variance, continuity correction
    N = n + m
    ties = {}
    for r in ranks:
        ties[r] = ties.get(r, 0) + 1
    var = n * m / 12 * ((N + 1) - sum(t ** 3 - t for t in ties.values()) / (N * (N - 1)))
    if var <= 0:
        return 1.0
    z = max(0.0, abs(observed - expected) / 2 - 0.5) / math.sqrt(var)
    return min(1.0, math.erfc(z / math.sqrt(2)))


@lru_cache(maxsize=256)
def _rank_sum_counts(doubled: tuple[int, ...], n: int) -> dict[int, int]:
    """How many of the C(N, n) ways to pick ``n`` of the pooled (doubled) ranks give each sum."""
    table: list[dict[int, int]] = [{} for _ in range(n + 1)]
    table[0][0] = 1
    for r in doubled:
        for k in range(n, 0, -1):
            below = table[k - 1]
            row = table[k]
            for s, c in below.items():
                row[s + r] = row.get(s + r, 0) + c
    return table[n]


@lru_cache(maxsize=256)
def _u_cdf(n: int, m: int) -> tuple[float, ...]:
    """P(U <= u) for u = 0..n*m under the null, no ties (the classic recurrence)."""
    # f[i][j][u]: arrangements of i x's and j y's with U = u
    f = [[None] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        for j in range(m + 1):
            if i == 0 or j == 0:
                f[i][j] = [1]
                continue
            a, b = f[i - 1][j], f[i][j - 1]  # largest value is an x (adds j to U) or a y
            out = [0] * (i * j + 1)
            for u, c in enumerate(a):
                out[u + j] += c
            for u, c in enumerate(b):
                out[u] += c
            f[i][j] = out
    counts = f[n][m]
    total = sum(counts)
    cdf, acc = [], 0
    for c in counts:
        acc += c
        cdf.append(acc / total)
    return tuple(cdf)


def min_p(n: int, m: int) -> float:
    """The smallest two-sided p the exact test can reach with n and m values: complete separation."""
    return min(1.0, 2 / math.comb(n + m, n))


@dataclass(frozen=True)
class Shift:
    """How ``y`` differs from ``x``: the Hodges-Lehmann estimate and its interval, on the scale
    asked for (a ratio y/x, or a difference y - x), and the U test's p."""

    estimate: float
    low: float  # -inf / 0 when the samples are too small for an interval at this level
    high: float
    p: float
    confidence: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def _moses_rank(n: int, m: int, alpha: float) -> int:
    """The k of the (1-alpha) interval [d_(k), d_(nm+1-k)] of the sorted pairwise differences:
    the largest k with P(U <= k-1) <= alpha/2; 0 when no interval has that confidence."""
    if n + m > EXACT_MAX:
        z = _normal_quantile(1 - alpha / 2)
        k = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12))
        return max(k, 0)
    cdf = _u_cdf(n, m)
    k = 0
    while k < len(cdf) and cdf[k] <= alpha / 2 + 1e-12:
        k += 1
    return k


def _normal_quantile(q: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def shift(x: list[float], y: list[float], *, alpha: float = 0.01, log_ratio: bool = False) -> Shift:
    """Hodges-Lehmann shift of ``y`` against ``x`` with its (1-alpha) interval and the U test's
    p. ``log_ratio``: on log values, reported as the ratio y/x (the values must be positive)."""
    if log_ratio:
        if min(x + y) <= 0:
            raise ValueError("a ratio needs positive values")
        x, y = [math.log(v) for v in x], [math.log(v) for v in y]
    diffs = sorted(b - a for a in x for b in y)
    half = len(diffs) // 2
    est = diffs[half] if len(diffs) % 2 else (diffs[half - 1] + diffs[half]) / 2
    k = _moses_rank(len(x), len(y), alpha)
    low, high = (diffs[k - 1], diffs[len(diffs) - k]) if k >= 1 else (-math.inf, math.inf)
    p = mann_whitney_p(x, y)
    if log_ratio:
        est, low, high = math.exp(est), math.exp(low) if low > -math.inf else 0.0, math.exp(high) if high < math.inf else math.inf
    return Shift(estimate=est, low=low, high=high, p=p, confidence=1 - alpha)


def median(values: list[float]) -> float:
    s = sorted(values)
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2
