"""Evaluation metrics as pure functions: pass@k, maj@k, length statistics, the train-vs-held-out
reward gap and win rate with a confidence interval.

pass@k is `rlft.eval.generation.pass_at_k` (the unbiased estimator of Chen et al. 2021); it is
re-exported here so every metric has one home.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Hashable, Sequence

from rlft.eval.generation import pass_at_k

__all__ = ["pass_at_k", "maj_at_k", "normalize_answer", "length_stats", "reward_gap", "WinRate", "win_rate",
           "wilson_interval"]


def normalize_answer(answer: str | None) -> str | None:
    """The form answers are compared in for a vote: no whitespace, no trailing period, no thousands
    separators in numbers ('1,000' and '1000' vote together). None (no answer) stays None.

    >>> normalize_answer(" 1,000. ")
    '1000'
    """
    if answer is None:
        return None
    text = re.sub(r"\s+", "", answer).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text or None


def _class_order(answers: Sequence[Hashable | None]) -> list[Hashable]:
    """Answer classes in tie-break order: more frequent over all n samples first, then by
    `str()` of the answer -- a fixed order, so a vote inside any subset is deterministic."""
    counts: dict[Hashable, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    return sorted(counts, key=lambda a: (-counts[a], str(a)))


def majority_answer(answers: Sequence[Hashable | None], order: Sequence[Hashable]) -> Hashable | None:
    """The most frequent non-None answer; a tie goes to the class earliest in `order`."""
    counts: dict[Hashable, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return None
    rank = {a: i for i, a in enumerate(order)}
    return min(counts, key=lambda a: (-counts[a], rank[a]))


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one prompt from n >= k samples: the probability that a majority vote over k samples
    drawn without replacement (a uniformly random k-subset) picks a correct answer.

    - `answers[i]` is sample i's normalised answer (None: no answer; it never wins a vote);
    - ties between answers go to the class earlier in a fixed order (more frequent over all n
      samples, then `str(answer)`), so the result is a deterministic function of the samples;
    - an answer class is correct when more than half of its samples were judged correct (with a
      consistent judge, simply "its answer is right"); a subset without any answer scores 0.

    Computed exactly, averaging over all C(n, k) subsets by counting: for each count x of the
    correct class in the subset, the other classes' counts must lose the vote (x_j < x, or x_j == x
    and they rank later), which a product-of-binomials convolution counts. With k = n it is the
    plain majority vote; with k = 1 it is the share of samples whose answer class is correct.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"maj@k: {n} answers but {len(correct)} correctness flags")
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs 1 <= k <= n samples per prompt, got n={n}")
    order = _class_order(answers)
    sizes = {a: 0 for a in order}
    right = {a: 0 for a in order}
    for a, ok in zip(answers, correct):
        if a is not None:
            sizes[a] += 1
            right[a] += bool(ok)
    none_count = n - sum(sizes.values())
    total = 0
    for rank, cls in enumerate(order):
        if 2 * right[cls] <= sizes[cls]:
            continue
        others = [(sizes[o], r < rank) for r, o in enumerate(order) if o != cls]
        for x in range(1, min(sizes[cls], k) + 1):
            # ways[t]: choices of t samples from the other classes (and no-answer samples) that lose to x
            ways = [math.comb(none_count, t) for t in range(k - x + 1)]
            for size, beats_on_tie in others:
                cap = x - 1 if beats_on_tie else x  # an earlier class wins a tie, so it must stay below x
                ways = [sum(ways[t - j] * math.comb(size, j) for j in range(0, min(cap, size, t) + 1))
                        for t in range(k - x + 1)]
            total += math.comb(sizes[cls], x) * ways[k - x]
    return total / math.comb(n, k)


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Mean and (population) std of completion lengths in tokens, and the truncated share."""
    n = len(lengths)
    if n == 0 or len(truncated) != n:
        raise ValueError(f"length_stats: need as many truncation flags as lengths (got {n} and {len(truncated)})")
    mean = sum(lengths) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in lengths) / n)
    return {"length_mean": mean, "length_std": std, "truncation_rate": sum(map(bool, truncated)) / n}


def reward_gap(train_rewards: Sequence[float | None], heldout_rewards: Sequence[float | None]) -> dict[str, float]:
    """Mean reward on training prompts minus on held-out prompts (unverifiable Nones left out): a
    growing positive gap means the policy fits its training prompts rather than the task."""
    def mean(values: Sequence[float | None]) -> float:
        kept = [v for v in values if v is not None]
        return sum(kept) / len(kept) if kept else float("nan")

    train, held = mean(train_rewards), mean(heldout_rewards)
    return {"reward_train": train, "reward_heldout": held, "reward_gap": train - held}


def wilson_interval(successes: float, n: float, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a proportion (Wilson 1927; Brown, Cai & DasGupta 2001 recommend it
    over the normal approximation for small n or proportions near 0 or 1)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class WinRate:
    wins: int
    ties: int
    losses: int
    rate: float  # (wins + ties / 2) / n
    low: float  # 95% Wilson interval of `rate`
    high: float

    def metrics(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}win_rate": self.rate, f"{prefix}win_rate_low": self.low, f"{prefix}win_rate_high": self.high,
                f"{prefix}wins": float(self.wins), f"{prefix}ties": float(self.ties),
                f"{prefix}losses": float(self.losses)}


def win_rate(scores_a: Sequence[float], scores_b: Sequence[float], tie_margin: float = 0.0) -> WinRate:
    """How often A beats B on paired items (same prompt, scored by the same judge or reward).

    A pair is a tie when |a - b| <= tie_margin; ties count half. The 95% interval is Wilson's score
    interval on n pairs with wins + ties/2 successes: closed form, deterministic, and well behaved
    near 0 and 1 where a normal interval leaves [0, 1] (a seeded bootstrap would also be
    deterministic, but costs resampling and adds nothing for one proportion)."""
    if len(scores_a) != len(scores_b):
        raise ValueError(f"win_rate: {len(scores_a)} scores for A but {len(scores_b)} for B; they must be paired")
    if not scores_a:
        raise ValueError("win_rate: no pairs")
    if tie_margin < 0:
        raise ValueError(f"win_rate: tie_margin must be >= 0, got {tie_margin}")
    wins = ties = losses = 0
    for a, b in zip(scores_a, scores_b):
        if abs(a - b) <= tie_margin:
            ties += 1
        elif a > b:
            wins += 1
        else:
            losses += 1
    n = len(scores_a)
    rate = (wins + ties / 2) / n
    low, high = wilson_interval(wins + ties / 2, n)
    return WinRate(wins, ties, losses, rate, low, high)
