"""The gate's statistic on synthetic samples of known outcome: exact Mann-Whitney p-values (ties
included) against a brute-force permutation count and published values, the Hodges-Lehmann ratio
and its interval, and what a gate with too few rounds can and cannot say."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from harness.gate import stats


def _brute_p(x, y):
    """Two-sided permutation p of the rank-sum statistic, by enumerating every split."""
    pooled = [*x, *y]
    ranks = stats._midranks(pooled)
    n = len(x)
    expected = n * (len(pooled) + 1) / 2
    observed = abs(sum(ranks[:n]) - expected)
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), n):
        total += 1
        hits += abs(sum(ranks[i] for i in idx) - expected) >= observed - 1e-9
    return hits / total


def test_complete_separation_of_five_rounds_is_p_2_over_252():
    assert stats.mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert stats.min_p(5, 5) == pytest.approx(2 / 252) and stats.min_p(5, 5) < 0.01
    assert stats.min_p(4, 4) > 0.01  # four rounds a side can never reach p < 0.01


def test_published_value():
    # Mann-Whitney exact two-sided, n = m = 4, U = 1: p = 2 * 2/70
    assert stats.mann_whitney_p([1, 2, 3, 5], [4, 6, 7, 8]) == pytest.approx(4 / 70)


@pytest.mark.parametrize("seed", range(8))
def test_exact_p_matches_brute_force_with_ties(seed):
    rng = random.Random(seed)
    n, m = rng.randint(2, 6), rng.randint(2, 6)
    x = [rng.choice([1.0, 2.0, 2.5, 3.0, 4.0]) for _ in range(n)]  # many ties
    y = [rng.choice([2.0, 3.0, 3.5, 4.0, 5.0]) for _ in range(m)]
    assert stats.mann_whitney_p(x, y) == pytest.approx(_brute_p(x, y))


def test_identical_samples_cannot_be_told_apart():
    assert stats.mann_whitney_p([5.0] * 6, [5.0] * 6) == 1.0
    s = stats.shift([5.0] * 6, [5.0] * 6, log_ratio=True)
    assert s.estimate == 1.0 and s.contains(1.0) and s.p == 1.0


def test_normal_approximation_agrees_with_exact_near_the_switch():
    rng = random.Random(3)
    x = [rng.gauss(0, 1) for _ in range(30)]
    y = [rng.gauss(0.8, 1) for _ in range(30)]
    approx = stats.mann_whitney_p(x, y)  # 60 values: still exact
    old, stats.EXACT_MAX = stats.EXACT_MAX, 10
    try:
        assert stats.mann_whitney_p(x, y) == pytest.approx(approx, rel=0.1)
    finally:
        stats.EXACT_MAX = old


def test_ratio_of_a_known_slowdown_and_its_interval():
    rng = random.Random(0)
    base = [100 * (1 + rng.uniform(-0.01, 0.01)) for _ in range(6)]
    head = [110 * (1 + rng.uniform(-0.01, 0.01)) for _ in range(6)]
    s = stats.shift(base, head, alpha=0.01, log_ratio=True)
    assert s.estimate == pytest.approx(1.10, abs=0.02)
    assert s.low > 1.0 and s.contains(1.10) and s.p < 0.01
    # the interval excludes no-change exactly when the test is significant
    same = stats.shift(base, [b * (1 + rng.uniform(-0.01, 0.01)) for b in base], alpha=0.01, log_ratio=True)
    assert same.contains(1.0) and same.p >= 0.01


def test_memory_shift_in_mib_with_identical_rounds():
    s = stats.shift([1000.0] * 5, [1256.0] * 5, alpha=0.01)
    assert s.estimate == 256 and s.low == s.high == 256 and s.p == pytest.approx(2 / 252)


def test_too_few_rounds_give_no_interval():
    s = stats.shift([1.0, 2.0], [3.0, 4.0], alpha=0.01, log_ratio=True)
    assert s.low == 0.0 and math.isinf(s.high) and s.p > 0.01


def test_interval_coverage_on_simulated_a_a():
    """1 - alpha intervals of A/A samples contain 1.0 at least 1 - alpha of the time."""
    rng = random.Random(11)
    misses = 0
    trials = 300
    for _ in range(trials):
        a = [rng.lognormvariate(0, 0.03) for _ in range(5)]
        b = [rng.lognormvariate(0, 0.03) for _ in range(5)]
        misses += not stats.shift(a, b, alpha=0.05, log_ratio=True).contains(1.0)
    assert misses / trials <= 0.05 + 0.03
