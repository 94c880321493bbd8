"""One validation report per dataset: counts per reason and the first offending rows.

Every dataset kind is checked before training starts. A defect stops the run (the default) or,
with `data.on_invalid: drop`, the rows are dropped and the same report is printed; nothing is
truncated or dropped silently.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, TypeVar

from rlft.data.readers import Row
from rlft.errors import DataError

log = logging.getLogger(__name__)
T = TypeVar("T")


class RowError(Exception):
    """A defect in one row: `reason` groups rows in the report, `detail` is row specific."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class ValidationReport:
    def __init__(self, source: str, kind: str):
        self.source, self.kind = source, kind
        self.total = 0
        self.problems: dict[str, list[tuple[str, str]]] = defaultdict(list)

    @property
    def n_invalid(self) -> int:
        return sum(len(v) for v in self.problems.values())

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.problems[reason].append((where, detail))

    def format(self, examples: int = 3) -> str:
        lines = [f"{self.source}: {self.n_invalid} of {self.total} {self.kind} rows are invalid"]
        for reason, rows in sorted(self.problems.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(rows):>6} x {reason}")
            for where, detail in rows[:examples]:
                lines.append(f"           {where}" + (f": {detail}" if detail else ""))
            if len(rows) > examples:
                lines.append(f"           ... and {len(rows) - examples} more")
        return "\n".join(lines)


def check_rows(rows: Iterable[Row], encode: Callable[[Row], T], source: str, kind: str,
               on_invalid: str = "error") -> list[T]:
    """Encode every row; collect RowErrors into one report; stop or drop as configured."""
    report = ValidationReport(source, kind)
    kept: list[T] = []
    for row in rows:
        report.total += 1
        if row.data is None:
            report.add(row.error or "unreadable row", row.where)
            continue
        try:
            kept.append(encode(row))
        except RowError as err:
            report.add(err.reason, row.where, err.detail)
    if report.total == 0:
        raise DataError(f"{source}: no rows found; the dataset is empty")
    if report.n_invalid:
        text = report.format()
        if on_invalid == "error":
            raise DataError(text + "\nFix the rows above, or set data.on_invalid=drop to drop them with this report.")
        log.warning("%s\nDropped %d invalid rows (data.on_invalid=drop).", text, report.n_invalid)
        if not kept:
            raise DataError(text + "\nEvery row is invalid; nothing left to train on.")
    return kept


def require_field(data: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    if name not in data or data[name] is None:
        raise RowError(f"missing field '{name}'", f"{what} needs '{name}'")
    value = data[name]
    allowed = _as_tuple(types)
    # bool is an int subclass: refuse True/False where a number is expected, not where anything goes
    bool_for_number = isinstance(value, bool) and bool not in allowed and any(t in (int, float) for t in allowed)
    if not isinstance(value, types) or bool_for_number:
        names = "/".join(t.__name__ for t in _as_tuple(types))
        raise RowError(f"wrong type for '{name}'", f"expected {names}, got {type(value).__name__}")
    if isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value):
        raise RowError(f"empty '{name}'")
    if isinstance(value, float) and not math.isfinite(value):
        # JSON's NaN / Infinity literals parse as floats; a reward would compare against "nan"
        # (and 'The answer is nan.' would score as correct)
        raise RowError(f"non-finite '{name}'", f"{value!r}; write a finite number or a string")
    return value


def require_fields(data: dict[str, Any], names: Iterable[str], what: str) -> None:
    """Each of `names` present and non-empty, of any type (e.g. what the reward functions read)."""
    for name in names:
        require_field(data, name, object, what)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def check_messages(value: Any, field: str = "messages") -> list[dict[str, str]]:
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise RowError(f"malformed '{field}'", f"item {i} must be {{'role': str, 'content': str}}")
    return value
