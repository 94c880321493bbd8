"""Shaping rewards and guards: small terms added next to a correctness reward so that length,
repetition and truncation cannot be exploited (policies learn to pad, loop and ramble when only
the answer is checked; DAPO, arXiv:2503.14476, §3.4), and a safety guard.

Each is its own registered factory and so its own logged component. Token counts come from the
trainer (`row['completion_tokens']`, `row['max_new_tokens']`, `row['finish_reason']`); a
function that needs one and does not get it stops with a message rather than guess in other units.
"""

from __future__ import annotations

import re
from typing import Any

from rlft.rewards.scoring import RewardFn, register_reward


def _row_int(row: dict[str, Any], key: str, who: str) -> int:
    value = row.get(key)
    if value is None:
        raise ValueError(f"{who} needs row[{key!r}] (the trainer passes it with every completion)")
    return int(value)


@register_reward("length_penalty")
def length_penalty(min_tokens: int = 0, max_tokens: int | None = None, per_token: float = 0.001,
                   max_penalty: float = 0.5) -> RewardFn:
    """0 inside [min_tokens, max_tokens]; outside, -per_token for each token beyond the nearer
    bound, capped at -max_penalty.

    >>> length_penalty(10, 20, per_token=0.01)("q", "...", completion_tokens=25)
    -0.05
    """
    if max_tokens is not None and max_tokens < min_tokens:
        raise ValueError(f"length_penalty: max_tokens ({max_tokens}) < min_tokens ({min_tokens})")
    if per_token < 0 or max_penalty < 0:
        raise ValueError("length_penalty: per_token and max_penalty are magnitudes (>= 0)")

    def reward(prompt: str, completion: str, **row: Any) -> float:
        n = _row_int(row, "completion_tokens", "length_penalty")
        excess = max(0, min_tokens - n) + (max(0, n - max_tokens) if max_tokens is not None else 0)
        return -min(max_penalty, per_token * excess)

    return reward


def repetition_rate(units: list[str], n: int) -> float:
    """1 - distinct n-grams / n-grams: 0 for no repeated n-gram, towards 1 for a loop."""
    grams = [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@register_reward("repetition_penalty")
def repetition_penalty(n: int = 3, scale: float = 1.0, unit: str = "word") -> RewardFn:
    """-scale × n-gram repetition rate over words (or characters, for text without spaces).

    >>> repetition_penalty(n=2)("q", "a b a b a b")  # 5 bigrams, 2 distinct: 1 - 2/5
    -0.6
    """
    if n < 1:
        raise ValueError(f"repetition_penalty: n must be >= 1, got {n}")
    if unit not in ("word", "char"):
        raise ValueError(f"repetition_penalty: unit must be 'word' or 'char', got {unit!r}")

    def reward(prompt: str, completion: str, **row: Any) -> float:
        units = completion.split() if unit == "word" else list(completion)
        return -scale * repetition_rate(units, n)

    return reward


@register_reward("finish_cleanly")
def finish_cleanly(penalty: float = 0.1, bonus: float = 0.05) -> RewardFn:
    """-penalty when generation hit max length without EOS (finish_reason 'length'), +bonus for a
    clean stop: answer, then stop, instead of running on to the length limit."""

    def reward(prompt: str, completion: str, **row: Any) -> float:
        reason = row.get("finish_reason")
        if reason == "length":
            return -abs(penalty)
        if reason == "stop":
            return abs(bonus)
        raise ValueError(f"finish_cleanly needs row['finish_reason'] of 'stop' or 'length', got {reason!r}")

    return reward


@register_reward("overlong")
def overlong(cache_tokens: int | None = None, cache_fraction: float = 0.2) -> RewardFn:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13): with L = max_new_tokens and a
    soft window of C tokens, 0 up to L - C, then linear down to -1 at L (and -1 beyond).

    C is `cache_tokens`, or `cache_fraction` × L (DAPO used 4096 of 20480, i.e. 0.2).

    >>> overlong(cache_tokens=100)("q", "...", completion_tokens=950, max_new_tokens=1000)
    -0.5
    """
    if cache_tokens is not None and cache_tokens <= 0:
        raise ValueError(f"overlong: cache_tokens must be > 0, got {cache_tokens}")
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"overlong: cache_fraction must be in (0, 1], got {cache_fraction}")

    def reward(prompt: str, completion: str, **row: Any) -> float:
        n = _row_int(row, "completion_tokens", "overlong")
        limit = _row_int(row, "max_new_tokens", "overlong")
        cache = min(limit, cache_tokens if cache_tokens is not None else max(1, round(cache_fraction * limit)))
        if n <= limit - cache:
            return 0.0
        if n > limit:
            return -1.0
        return (limit - cache - n) / cache

    return reward


@register_reward("safety_guard")
def safety_guard(patterns: list[str] | None = None, words: list[str] | None = None, floor: float = -1.0,
                 case_sensitive: bool = False) -> RewardFn:
    """A guard: `floor` when the completion matches any regex in `patterns` or
    contains any of `words` (whole words), else 0.0. The scorer replaces the whole total with the
    floor when a guard fires, whatever else the sample earned.

    >>> guard = safety_guard(words=["rm -rf"])
    >>> guard("q", "just run rm -rf / now"), guard("q", "all good")
    (-1.0, 0.0)
    """
    regexes = list(patterns or []) + [rf"(?<!\w){re.escape(w)}(?!\w)" for w in (words or [])]
    if not regexes:
        raise ValueError("safety_guard: give at least one entry in 'patterns' or 'words'")
    if floor >= 0:
        raise ValueError(f"safety_guard: floor must be negative (it replaces the reward), got {floor}")
    try:
        compiled = re.compile("|".join(f"(?:{r})" for r in regexes), 0 if case_sensitive else re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"safety_guard: bad pattern: {exc}") from None

    def guard(prompt: str, completion: str, **row: Any) -> float:
        return floor if compiled.search(completion) else 0.0

    guard.is_guard = True
    return guard
