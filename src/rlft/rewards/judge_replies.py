"""Reading a score or a pairwise verdict out of an LLM judge's free-text reply.

Judges are asked to end with a fixed line ("Score: N", "Verdict: W") or a JSON object, but models
restate the format, reason before answering, or wrap JSON in a code fence. So every reply is read
the same way whatever format was asked for, most explicit form first:

1. a JSON object (the whole reply, a ```json fence, or the last {...} in the text) with `score`
   (or `rating`, `grade`) or `verdict` (pairwise: `winner`, `verdict`);
2. the last "Score: N" / "Rating: N/10" / "Verdict: W" line (the last, because a judge that
   restates the instructions mentions the format before it answers);
3. a reply that is nothing but a number ("7", "7/10") or a verdict word ("Correct.").

A verdict word inside prose ("the answer is not correct") is never read: it would need a parser
that understands negation. Anything else is None: unverifiable, never a guess.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE_LINE = re.compile(rf"\b(?:score|rating|grade)\**\s*[:=]\s*\**\s*({_NUMBER})(?:\s*/\s*({_NUMBER}))?",
                         re.IGNORECASE)
_VERDICT_LINE = re.compile(r"\b(?:verdict|winner|decision)\**\s*[:=]\s*\**\s*\[?([A-Za-z]+)\]?", re.IGNORECASE)
_BARE_NUMBER = re.compile(rf"\s*({_NUMBER})\s*(?:/\s*({_NUMBER}))?\s*\.?\s*")
_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL | re.IGNORECASE)
_LAST_OBJECT = re.compile(r"\{[^{}]*\}", re.DOTALL)
_SCORE_KEYS = ("score", "rating", "grade")
_PAIR_WORDS = {"a": "a", "b": "b", "tie": "tie", "draw": "tie", "equal": "tie", "[[a]]": "a", "[[b]]": "b",
               "[[c]]": "tie"}


def parse_score(reply: str, low: float, high: float, verdicts: dict[str, float]) -> tuple[float, float] | None:
    """(reward in [0, 1] or a verdict's value, the judge's own number or verdict value), or None.

    A number is mapped from [low, high] to [0, 1]; one outside that range, or written over another
    scale ("4/5" when the scale ends at 10), is None: the judge did not follow the rubric.

    >>> v = {"correct": 1.0, "incorrect": 0.0}
    >>> parse_score("Clear and right.\\nScore: 7", 0, 10, v)
    (0.7, 7.0)
    >>> parse_score('```json\\n{"score": 3}\\n```', 0, 10, v), parse_score("Incorrect.", 0, 10, v)
    ((0.3, 3.0), (0.0, 0.0))
    >>> parse_score("Score: 12", 0, 10, v), parse_score("It is not correct", 0, 10, v)
    (None, None)
    """
    found = _json_field(reply, _SCORE_KEYS + ("verdict",))
    if found is None:
        found = _last_score_line(reply) or _last_verdict_line(reply) or _bare(reply)
    if found is None:
        return None
    if isinstance(found, str):
        value = verdicts.get(found.strip().lower())
        return None if value is None else (float(value), float(value))
    number, scale = found
    if scale is not None and scale != high:
        return None
    if not (math.isfinite(number) and low <= number <= high):
        return None
    return (number - low) / (high - low), number


def parse_pair_verdict(reply: str) -> str | None:
    """"a", "b" or "tie" from a pairwise judge's reply, or None.

    >>> [parse_pair_verdict(r) for r in ("Verdict: B", '{"winner": "tie"}', "[[A]]", "A.", "Both fine")]
    ['b', 'tie', 'a', 'a', None]
    """
    found = _json_field(reply, ("winner", "verdict"))
    if not isinstance(found, str):
        found = _last_verdict_line(reply)
    if found is None:
        matches = re.findall(r"\[\[[ABC]\]\]", reply)  # MT-Bench's "[[A]]" convention
        found = matches[-1] if matches else reply.strip().strip("*.").strip()
    return _PAIR_WORDS.get(found.strip().lower()) if isinstance(found, str) else None


def _json_field(reply: str, keys: tuple[str, ...]) -> tuple[float, None] | str | None:
    """The first of `keys` in the reply's JSON object: a number as (number, None), a word as str."""
    candidates = [reply.strip()] + _FENCE.findall(reply)[::-1] + _LAST_OBJECT.findall(reply)[::-1]
    for text in candidates:
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in keys:
            value = _lower_keys(obj).get(key)
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                return float(value), None
            if isinstance(value, str):
                number = _as_number(value)
                return (number, None) if number is not None else value
    return None


def _lower_keys(obj: dict[str, Any]) -> dict[str, Any]:
    return {str(k).lower(): v for k, v in obj.items()}


def _last_score_line(reply: str) -> tuple[float, float | None] | None:
    matches = _SCORE_LINE.findall(reply)
    if not matches:
        return None
    number, scale = matches[-1]
    return float(number), float(scale) if scale else None


def _last_verdict_line(reply: str) -> str | None:
    matches = _VERDICT_LINE.findall(reply)
    return matches[-1] if matches else None


def _bare(reply: str) -> tuple[float, float | None] | str | None:
    """A reply that is only a number (possibly "N/M") or only one word."""
    match = _BARE_NUMBER.fullmatch(reply)
    if match:
        return float(match.group(1)), float(match.group(2)) if match.group(2) else None
    word = reply.strip().strip("*.!").strip()
    return word if word and word.isalpha() else None


def _as_number(text: str) -> float | None:
    match = _BARE_NUMBER.fullmatch(text)
    return float(match.group(1)) if match and not match.group(2) else None
