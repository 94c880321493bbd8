"""One accumulator for the metrics of a step's parts (micro-batches, minibatches, epochs)."""

from __future__ import annotations

from typing import Any


class MetricAccumulator:
    """Weighted sums per key; keys ending in `max` / `min` keep the extreme instead.

    `means()` divides each sum by the weight it was added with (e.g. per-token metrics weighted
    by token counts); `sums()` returns the plain sums, for metrics their producer already scaled
    to add up over the step (the offline objectives do).
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            if key.endswith("max"):
                self._sums[key] = max(self._sums.get(key, float("-inf")), value)
            elif key.endswith("min"):
                self._sums[key] = min(self._sums.get(key, float("inf")), value)
            else:
                self._sums[key] = self._sums.get(key, 0.0) + value * weight
                self._weights[key] = self._weights.get(key, 0.0) + weight

    def reduce(self, world: Any) -> "MetricAccumulator":
        """Every rank's parts combined (sums and weights added, extremes kept), on every rank; a key
        only some ranks saw counts as 0 (weight 0) or no extreme on the others."""
        if not getattr(world, "active", False):
            return self
        keys = sorted(set().union(*world.gather(sorted(self._sums))))
        extremes = [k for k in keys if k.endswith(("max", "min"))]
        added = [k for k in keys if k not in extremes]
        sums = world.sum([self._sums.get(k, 0.0) for k in added] + [self._weights.get(k, 0.0) for k in added])
        tops = world.max([self._sums.get(k, float("-inf")) if k.endswith("max") else -self._sums.get(k, float("inf"))
                          for k in extremes])
        out = MetricAccumulator()
        out._sums = {k: v for k, v in zip(added, sums[:len(added)])}
        out._weights = {k: v for k, v in zip(added, sums[len(added):])}
        out._sums.update({k: (v if k.endswith("max") else -v) for k, v in zip(extremes, tops)})
        return out

    def sums(self) -> dict[str, float]:
        return dict(self._sums)

    def means(self) -> dict[str, float]:
        out = {}
        for key, total in self._sums.items():
            if key in self._weights:
                w = self._weights[key]
                out[key] = total / w if w else 0.0
            else:
                out[key] = total
        return out


def world_sums(world: Any, metrics: dict[str, float]) -> dict[str, float]:
    """Counters summed over ranks (every rank sees the same keys: a missing one counts 0); keys
    ending in `max` / `min` keep the extreme. A collective: every rank calls it."""
    acc = MetricAccumulator()
    acc.add(metrics)
    return acc.reduce(world).sums()
