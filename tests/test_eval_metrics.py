"""Eval metrics: maj@k against its combinatorial definition, win rate with a Wilson interval,
length statistics and the train-vs-held-out reward gap."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from rlft.eval import generation
from rlft.eval.metrics import (_class_order, length_stats, maj_at_k, majority_answer, normalize_answer, pass_at_k,
                               reward_gap, wilson_interval, win_rate)


def maj_at_k_by_enumeration(answers, correct, k):
    """The definition: the vote of every k-subset of the n samples, averaged."""
    order = _class_order(answers)
    class_ok = {}
    for a in order:
        verdicts = [c for x, c in zip(answers, correct) if x == a]
        class_ok[a] = 2 * sum(verdicts) > len(verdicts)
    votes = [majority_answer([answers[i] for i in subset], order)
             for subset in itertools.combinations(range(len(answers)), k)]
    return sum(v is not None and class_ok[v] for v in votes) / len(votes)


def test_pass_at_k_is_the_existing_estimator():
    assert pass_at_k is generation.pass_at_k


def test_maj_at_k_hand_computed():
    answers = ["4", "4", "5", None]
    correct = [True, True, False, False]
    # k = 1: a subset of one sample is correct when that sample's class is "4": 2 of 4
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5)
    # k = 2, the C(4,2) = 6 pairs: {4,4} -> 4 ok; {4,5} x2 -> tie, "4" is more frequent over all
    # samples so it wins: ok; {4,None} x2 -> 4 ok; {5,None} -> 5 wrong: 5 of 6
    assert maj_at_k(answers, correct, 2) == pytest.approx(5 / 6)
    # k = n: the plain majority vote over all samples
    assert maj_at_k(answers, correct, 4) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # no answer never wins
    # a tie between equally frequent classes goes to the smaller str(): "3" before "7"
    assert maj_at_k(["7", "3"], [True, False], 2) == 0.0
    assert maj_at_k(["7", "3"], [False, True], 2) == 1.0


def test_maj_at_k_equals_the_average_over_all_subsets():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
        correct = [a == "2" for a in answers]
        if rng.random() < 0.25:  # an inconsistent judge: classes decided by their majority verdict
            correct = [rng.random() < 0.5 for _ in answers]
        assert maj_at_k(answers, correct, k) == pytest.approx(maj_at_k_by_enumeration(answers, correct, k), abs=1e-12)


def test_maj_at_k_rejects_bad_k():
    with pytest.raises(ValueError, match="maj@3"):
        maj_at_k(["1", "2"], [True, False], 3)
    with pytest.raises(ValueError, match="correctness"):
        maj_at_k(["1", "2"], [True], 1)


def test_normalize_answer():
    assert normalize_answer(" 1,000. ") == "1000"
    assert normalize_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("x = 3") == "x=3"
    assert normalize_answer("  ") is None and normalize_answer(None) is None


def test_win_rate_on_a_known_winner():
    a = [0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.2, 0.9, 0.4, 0.8]
    b = [0.1, 0.2, 0.3, 0.65, 0.5, 0.45, 0.3, 0.1, 0.1, 0.2]
    result = win_rate(a, b, tie_margin=0.06)
    # |a - b| <= 0.06 on items 3 (-0.05), 4 (0) and 5 (0.05): 3 ties; A higher on 0,1,2,7,8,9; lower on 6
    assert (result.wins, result.ties, result.losses) == (6, 3, 1)
    assert result.rate == pytest.approx((6 + 1.5) / 10)
    # Wilson, p = 0.75, n = 10, z = 1.96: centre (0.75 + 0.19207) / 1.38415 = 0.68060,
    # half width 1.96 * sqrt(0.01875 + 0.0096040) / 1.38415 = 0.23844 -> [0.4422, 0.9190]
    assert (result.low, result.high) == pytest.approx((0.4422, 0.9190), abs=1e-4)
    assert result.low > 0.4  # A is the better one, though 10 pairs cannot exclude a coin flip
    many = win_rate(a * 20, b * 20, tie_margin=0.06)
    assert many.rate == result.rate and many.low > 0.5  # 200 pairs do
    swapped = win_rate(b, a, tie_margin=0.06)
    assert (swapped.wins, swapped.losses) == (1, 6) and swapped.rate == pytest.approx(1 - result.rate)
    assert set(result.metrics("eval/")) >= {"eval/win_rate", "eval/win_rate_low", "eval/win_rate_high"}


def test_wilson_interval_edges():
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.0 < high < 0.35  # never the degenerate [0, 0] of the normal interval
    low, high = wilson_interval(10, 10)
    assert 0.65 < low < 1.0 and high == pytest.approx(1.0)
    with pytest.raises(ValueError, match="paired"):
        win_rate([1.0], [1.0, 2.0])


def test_length_stats_and_reward_gap():
    stats = length_stats([2, 4, 4, 4, 5, 5, 7, 9], [False] * 7 + [True])
    # mean 5, squared deviations 9+1+1+1+0+0+4+16 = 32 -> population std sqrt(32 / 8) = 2
    assert stats == {"length_mean": 5.0, "length_std": 2.0, "truncation_rate": 0.125}
    gap = reward_gap([1.0, 0.5, None], [0.25, 0.25])
    assert gap["reward_train"] == 0.75 and gap["reward_heldout"] == 0.25 and gap["reward_gap"] == 0.5
    assert math.isnan(reward_gap([None], [1.0])["reward_gap"])
