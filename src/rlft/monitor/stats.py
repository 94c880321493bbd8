"""One accumulator for the metrics of a step's parts (micro-batches, minibatches, epochs)."""

from __future__ import annotations


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
