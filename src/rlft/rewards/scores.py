"""What scoring produces: `Scores` for a batch of samples, and `Scored`, a reward's value with notes.

A reward may return `Scored(value, info)` instead of a bare value: `value` is the reward as usual
(float, None or a dict of parts) and `info` holds per-sample notes that are logged but never added
to the total: an LLM judge's reply, an ensemble's disagreement. Numeric notes are averaged into the
step's metrics as `reward/<component>/<key>`; every note goes into samples.jsonl with its sample.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

RewardValue = float | None | dict[str, float | None]
InfoValue = str | float | int | bool | None


@dataclass
class Scored:
    """A reward's value for one sample and notes about it (see the module docstring).

    >>> Scored(0.5, {"reply": "Score: 5"}).value
    0.5
    """

    value: Any
    info: dict[str, InfoValue] = field(default_factory=dict)


def unwrap(value: Any) -> tuple[Any, dict[str, Any]]:
    """(the bare value, its notes): a plain value has none."""
    if isinstance(value, Scored):
        return value.value, value.info
    return value, {}


def check_info(info: Any) -> str | None:
    """Why `info` cannot be logged as a sample's notes, or None when it can."""
    if not isinstance(info, dict):
        return f"Scored.info is a {type(info).__name__}; it must be a dict"
    for key, value in info.items():
        if not isinstance(key, str) or not key or "/" in key:
            return f"Scored.info key {key!r} must be a non-empty string without '/'"
        if value is not None and not isinstance(value, (str, numbers.Real)):
            return f"Scored.info[{key!r}] is a {type(value).__name__}; notes are text, numbers or None"
    return None


@dataclass
class Scores:
    """Rewards for N samples. `total[i]` is None when sample i could not be verified.

    `components` maps each component (and `<component>/<part>` of a dict reward) to its N values;
    `info` maps `<component>/<key>` to N notes (None where a sample has none), plus `disagreement`
    when an ensemble reports one (see `RewardScorer.score`).
    """

    total: list[float | None]
    components: dict[str, list[float | None]] = field(default_factory=dict)
    info: dict[str, list[InfoValue]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        valid = [r for r in self.total if r is not None]
        n = len(self.total)
        out["reward/mean"] = _mean(valid)
        out["reward/std"] = _std(valid)
        out["reward/unverifiable_frac"] = (n - len(valid)) / n if n else 0.0
        for name, values in self.components.items():
            out[f"reward/{name}"] = _mean([v for v in values if v is not None])
        for key, notes in self.info.items():
            numbers_ = [float(v) for v in notes if isinstance(v, numbers.Real)]
            if numbers_:  # text notes (a judge's reply) are for samples.jsonl, not metrics
                out[f"reward/{key}"] = _mean(numbers_)
        return out

    def sample_info(self, i: int) -> dict[str, InfoValue]:
        """Sample i's notes, without the keys it has none for."""
        return {k: v[i] for k, v in self.info.items() if v[i] is not None}

    def subset(self, pick: list[int]) -> "Scores":
        """The samples at indices `pick`, in that order."""
        return Scores([self.total[i] for i in pick], {k: [v[i] for i in pick] for k, v in self.components.items()},
                      {k: [v[i] for i in pick] for k, v in self.info.items()})

    @classmethod
    def concat(cls, parts: list["Scores"]) -> "Scores":
        """The samples of every part, in order (a key one part lacks is None for its samples)."""
        total: list[float | None] = [t for p in parts for t in p.total]
        out = cls(total)
        for attr in ("components", "info"):
            keys = list(dict.fromkeys(k for p in parts for k in getattr(p, attr)))
            getattr(out, attr).update({k: [v for p in parts for v in getattr(p, attr).get(k, [None] * len(p.total))]
                                       for k in keys})
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    try:
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    except OverflowError:  # |rewards| near 1e154 and above with scoring.max_abs_reward=null
        return float("inf")
