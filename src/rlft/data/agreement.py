"""Inter-annotator agreement on preference pairs.

Format: a preference row may carry its annotators' judgements as `"labels"`, one per annotator,
each "chosen" (prefers the row's `chosen` answer), "rejected" (prefers `rejected`) or "tie":

    {"prompt": "...", "chosen": "...", "rejected": "...", "labels": ["chosen", "chosen", "rejected"]}

Rows may have different numbers of labels; rows with fewer than two say nothing about agreement
and are only counted.

Metrics:
- percent agreement: per row, the share of annotator pairs that gave the same label, averaged over
  rows with at least two labels;
- Krippendorff's alpha for nominal data (Krippendorff 2011, "Computing Krippendorff's
  Alpha-Reliability", Univ. of Pennsylvania): 1 - observed / expected disagreement from the
  coincidence matrix; 1 is perfect agreement, 0 is chance level, below 0 systematic disagreement.
  Chosen over Fleiss' kappa because it allows a different number of annotators per row;
- majority support: share of rows whose most frequent label is "chosen" (the stored preference is
  what most annotators prefer; ties between labels do not count).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from rlft.errors import DataError

LABELS = ("chosen", "rejected", "tie")


def read_labels(rows: Sequence[Any]) -> list[list[str]]:
    """The `labels` of each row (`Row` objects or dicts), lower-cased and checked."""
    out = []
    for i, row in enumerate(rows):
        data, where = (row.data, row.where) if hasattr(row, "data") else (row, f"row {i + 1}")
        labels = data.get("labels") if isinstance(data, dict) else None
        if not isinstance(labels, list):
            raise DataError(f"{where}: no 'labels' list; add the annotators' judgements, e.g. "
                            '"labels": ["chosen", "chosen", "rejected"]')
        clean = [str(v).strip().lower() for v in labels]
        bad = [v for v in clean if v not in LABELS]
        if bad:
            raise DataError(f"{where}: labels {bad} are not one of {', '.join(LABELS)}")
        out.append(clean)
    return out


def percent_agreement(units: Sequence[Sequence[Hashable]]) -> float:
    """Mean share of agreeing annotator pairs per unit (units with < 2 labels left out)."""
    shares = []
    for labels in units:
        m = len(labels)
        if m < 2:
            continue
        same = sum(c * (c - 1) // 2 for c in Counter(labels).values())
        shares.append(same / (m * (m - 1) // 2))
    return sum(shares) / len(shares) if shares else float("nan")


def krippendorff_alpha_nominal(units: Sequence[Sequence[Hashable]]) -> float:
    """Krippendorff's alpha, nominal metric: 1 - (n - 1) * sum_{c != k} o_ck / sum_{c != k} n_c n_k,
    where o_ck counts ordered pairs of values (c, k) within a unit, each unit's pairs weighted
    1 / (m_u - 1), n_c = sum_k o_ck and n = sum_c n_c (the pairable values)."""
    coincidence: Counter = Counter()
    for labels in units:
        m = len(labels)
        if m < 2:
            continue
        counts = Counter(labels)
        for c, nc in counts.items():
            for k, nk in counts.items():
                pairs = nc * (nc - 1) if c == k else nc * nk
                coincidence[c, k] += pairs / (m - 1)
    totals: Counter = Counter()
    for (c, _), v in coincidence.items():
        totals[c] += v
    n = sum(totals.values())
    expected = sum(totals[c] * totals[k] for c in totals for k in totals if c != k)
    if n <= 1 or expected == 0:
        return float("nan")  # one value everywhere: agreement is undefined, not perfect
    observed = sum(v for (c, k), v in coincidence.items() if c != k)
    return 1.0 - (n - 1) * observed / expected


@dataclass(frozen=True)
class Agreement:
    rows: int
    rated_rows: int  # rows with at least two labels
    percent_agreement: float
    alpha: float
    majority_support: float

    def metrics(self) -> dict[str, float]:
        return {"agreement/rows": float(self.rows), "agreement/rated_rows": float(self.rated_rows),
                "agreement/percent": self.percent_agreement, "agreement/krippendorff_alpha": self.alpha,
                "agreement/majority_support": self.majority_support}


def agreement(units: Sequence[Sequence[str]]) -> Agreement:
    rated = [u for u in units if len(u) >= 2]
    support = 0
    for labels in units:
        top = Counter(labels).most_common(2)
        if top and top[0][0] == "chosen" and (len(top) == 1 or top[1][1] < top[0][1]):
            support += 1
    return Agreement(len(units), len(rated), percent_agreement(units), krippendorff_alpha_nominal(units),
                     support / len(units) if units else float("nan"))
