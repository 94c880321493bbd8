"""Shaping rewards and the safety guard: hand-computed values, bad arguments, composition."""

import pytest

from rlft.config import RewardSpec
from rlft.rewards import RewardScorer
from rlft.rewards.scoring import BUILTIN_REWARDS
from rlft.rewards.shaping import repetition_rate


def build(name, **args):
    return BUILTIN_REWARDS[name](**args)


@pytest.mark.parametrize("n, expected", [
    (15, 0.0),  # inside [10, 20]
    (10, 0.0), (20, 0.0),  # bounds are inside
    (25, -0.05),  # 5 over × 0.01
    (7, -0.03),  # 3 under × 0.01
    (500, -0.2),  # 480 over × 0.01 = 4.8, capped at 0.2
])
def test_length_penalty(n, expected):
    fn = build("length_penalty", min_tokens=10, max_tokens=20, per_token=0.01, max_penalty=0.2)
    assert fn("q", "c", completion_tokens=n) == pytest.approx(expected)


def test_length_penalty_without_upper_bound_and_errors():
    assert build("length_penalty", min_tokens=5)("q", "c", completion_tokens=10_000) == 0.0
    with pytest.raises(ValueError, match="max_tokens"):
        build("length_penalty", min_tokens=10, max_tokens=5)
    with pytest.raises(ValueError, match="completion_tokens"):
        build("length_penalty")("q", "c")


def test_repetition_penalty():
    # "a b a b a b": bigrams ab ba ab ba ab -> 5 total, 2 distinct -> rate 1 - 2/5 = 0.6
    assert build("repetition_penalty", n=2)("q", "a b a b a b") == pytest.approx(-0.6)
    # trigrams of "the cat sat on the mat": 4, all distinct -> 0
    assert build("repetition_penalty", n=3)("q", "the cat sat on the mat") == 0.0
    # characters "aaaa" with n=2: aa aa aa -> 1 - 1/3, scaled by 0.5
    assert build("repetition_penalty", n=2, unit="char", scale=0.5)("q", "aaaa") == pytest.approx(-(1 - 1 / 3) / 2)
    assert repetition_rate(["x"], 3) == 0.0  # shorter than n: nothing repeats
    with pytest.raises(ValueError):
        build("repetition_penalty", unit="token")


def test_finish_cleanly():
    fn = build("finish_cleanly", penalty=0.2, bonus=0.05)
    assert fn("q", "c", finish_reason="length") == -0.2
    assert fn("q", "c", finish_reason="stop") == 0.05
    with pytest.raises(ValueError, match="finish_reason"):
        fn("q", "c")


@pytest.mark.parametrize("n, expected", [
    (800, 0.0),  # up to L - C = 1000 - 200
    (900, -0.5),  # (800 - 900) / 200
    (1000, -1.0),  # at the limit
    (1200, -1.0),  # beyond (cannot happen with a hard limit, still bounded)
])
def test_overlong_dapo(n, expected):
    fn = build("overlong", cache_tokens=200)
    assert fn("q", "c", completion_tokens=n, max_new_tokens=1000) == pytest.approx(expected)


def test_overlong_default_cache_is_a_fraction_of_the_limit():
    fn = build("overlong")  # C = 0.2 × 1000 = 200, as in the paper's 4096 / 20480
    assert fn("q", "c", completion_tokens=950, max_new_tokens=1000) == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fn("q", "c", completion_tokens=5)


def test_safety_guard():
    guard = build("safety_guard", patterns=[r"api[_-]?key\s*="], words=["rm -rf", "bomb"], floor=-2.0)
    assert guard.is_guard is True
    assert guard("q", "set API_KEY = 123") == -2.0
    assert guard("q", "then rm -rf the folder") == -2.0
    assert guard("q", "the bombastic style") == 0.0  # whole words only
    assert guard("q", "all fine") == 0.0
    with pytest.raises(ValueError, match="at least one"):
        build("safety_guard")
    with pytest.raises(ValueError, match="negative"):
        build("safety_guard", words=["x"], floor=0.5)
    with pytest.raises(ValueError, match="bad pattern"):
        build("safety_guard", patterns=["("])


def test_components_are_logged_separately_and_a_firing_guard_replaces_the_total():
    scorer = RewardScorer([
        RewardSpec(fn="exact_match", weight=1.0),
        RewardSpec(fn="finish_cleanly", weight=2.0),
        RewardSpec(fn="overlong", args={"cache_tokens": 100}),
        RewardSpec(fn="safety_guard", args={"words": ["forbidden"], "floor": -1.0}),
    ], max_workers=1)
    rows = [dict(answer="42", finish_reason="stop", completion_tokens=10, max_new_tokens=200),
            dict(answer="42", finish_reason="length", completion_tokens=200, max_new_tokens=200),
            dict(answer="42", finish_reason="stop", completion_tokens=10, max_new_tokens=200)]
    scores = scorer.score(["q"] * 3, ["42", "41", "42 forbidden"], rows)
    # 1 + 2 × 0.05 + 0 = 1.1 ; 0 + 2 × (-0.1) + (-1) = -1.2 ; guard fires -> -1.0
    assert scores.total == pytest.approx([1.1, -1.2, -1.0])
    assert scores.components["overlong"] == [0.0, -1.0, 0.0]
    assert scores.components["safety_guard"] == [0.0, 0.0, -1.0]
