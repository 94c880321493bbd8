"""One row of a dataset as every reader returns it: where it came from (for errors that name the
row), its parsed fields, or why it could not be parsed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Row:
    where: str  # "data/train.jsonl:17" -- 1-based line, or "name[split]#index"
    data: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None  # parse error, reported by validation
