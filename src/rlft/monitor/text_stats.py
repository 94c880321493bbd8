"""Statistics of a batch of completion texts that the loop logs next to its metrics."""

from __future__ import annotations

from typing import Literal

from rlft.rewards.shaping import repetition_rate


def batch_repetition_rate(texts: list[str], n: int = 3, unit: Literal["word", "char"] = "word") -> float:
    """Mean over completions of the n-gram repetition rate (1 - distinct / total n-grams), logged
    as `completion/repetition_rate`. Completions with fewer than n units have no n-gram and say
    nothing about repetition, so they are left out; 0.0 when none is long enough.

    >>> batch_repetition_rate(["a b a b a b", "x y z", "hi"], n=2)  # (1 - 2/5 + 0) / 2; "hi" has no bigram
    0.3
    """
    rates = []
    for text in texts:
        units = text.split() if unit == "word" else list(text)
        if len(units) >= n:
            rates.append(repetition_rate(units, n))
    return sum(rates) / len(rates) if rates else 0.0
