"""Difficulty screening: keep the prompts a model solves sometimes, not always or never.

A prompt the policy always solves (or never solves) gives every completion of its group the same
reward, hence zero advantage in GRPO-style training: it costs a rollout and teaches nothing
(the motivation of DAPO's dynamic sampling, arXiv:2503.14476, applied once, before training).
`screen_prompts` samples k completions per prompt, scores them, and keeps prompts whose pass rate
lies in [low, high] (inclusive).

The sampler and the scorer are small callables, so the same code runs with the hf engine, vLLM,
multi-turn episodes (a config's agent section) or a test double:
- `sample(examples, k)` returns k completions per prompt example, grouped by prompt
  ([p0 c0..c(k-1), p1 c0.., ...], as `Engine.generate`), each a `Completion` or a string;
- `score(example, completion)` gets one of them and returns True/False (correct), a reward
  (correct when >= threshold), or None (could not be verified: left out of that prompt's pass rate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from rlft.data.prompts import PromptExample
from rlft.data.readers import Row


class Sampler(Protocol):
    def __call__(self, examples: list[PromptExample], k: int) -> Sequence[Any]: ...


Score = Callable[[PromptExample, Any], "bool | float | None"]  # (example, a Completion or a string)


@dataclass
class PromptRate:
    where: str
    correct: int
    scored: int  # completions with a verdict (k minus the unverifiable ones)

    @property
    def pass_rate(self) -> float | None:
        return self.correct / self.scored if self.scored else None


@dataclass
class ScreenResult:
    rates: list[PromptRate]
    kept: list[bool]
    low: float
    high: float
    counts: dict[str, int] = field(default_factory=dict)  # kept / too_easy / too_hard / unscored

    def histogram(self, bins: int = 10, width: int = 40) -> str:
        return pass_rate_histogram([r.pass_rate for r in self.rates if r.pass_rate is not None], bins, width)


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion.text


def is_correct(value: bool | float | None, threshold: float) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    return float(value) >= threshold


def screen_prompts(examples: Sequence[PromptExample], sample: Sampler, score: Score, k: int = 8,
                   low: float = 0.1, high: float = 0.9, threshold: float = 1.0,
                   batch_prompts: int = 64) -> ScreenResult:
    """Pass rate of each prompt over k samples; keep those with low <= rate <= high."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"screening bounds must satisfy 0 <= low <= high <= 1, got low={low}, high={high}")
    if k < 1:
        raise ValueError(f"samples per prompt must be >= 1, got {k}")
    rates: list[PromptRate] = []
    for start in range(0, len(examples), batch_prompts):
        chunk = list(examples[start:start + batch_prompts])
        completions = list(sample(chunk, k))
        if len(completions) != k * len(chunk):
            raise ValueError(f"the sampler returned {len(completions)} completions for {len(chunk)} prompts x {k}")
        for i, example in enumerate(chunk):
            verdicts = [is_correct(score(example, c), threshold) for c in completions[i * k:(i + 1) * k]]
            judged = [v for v in verdicts if v is not None]
            rates.append(PromptRate(example.where, sum(judged), len(judged)))
    kept, counts = [], {"kept": 0, "too_easy": 0, "too_hard": 0, "unscored": 0}
    for r in rates:
        rate = r.pass_rate
        keep = rate is not None and low <= rate <= high
        kept.append(keep)
        key = "unscored" if rate is None else "kept" if keep else "too_easy" if rate > high else "too_hard"
        counts[key] += 1
    return ScreenResult(rates, kept, low, high, counts)


def pass_rate_histogram(rates: Sequence[float], bins: int = 10, width: int = 40) -> str:
    """A text histogram of pass rates over [0, 1] (the last bin includes 1.0)."""
    counts = [0] * bins
    for r in rates:
        counts[min(int(r * bins), bins - 1)] += 1
    top = max(counts, default=0) or 1
    lines = []
    for i, c in enumerate(counts):
        lo, hi = i / bins, (i + 1) / bins
        bracket = "]" if i == bins - 1 else ")"
        lines.append(f"[{lo:.1f}, {hi:.1f}{bracket} {'#' * round(width * c / top):<{width}} {c}")
    return "\n".join(lines)


def original_lines(rows: Sequence[Row]) -> list[str]:
    """Each row as its source text: the file's own line for `file.jsonl:N` rows (byte for byte),
    else the row re-serialised as JSON."""
    cache: dict[str, list[str]] = {}
    out = []
    for row in rows:
        path, sep, line = row.where.rpartition(":")
        if sep and path.endswith(".jsonl") and line.isdigit() and Path(path).is_file():
            if path not in cache:
                cache[path] = Path(path).read_text(encoding="utf-8").split("\n")
            out.append(cache[path][int(line) - 1])
        else:
            out.append(json.dumps(row.data, ensure_ascii=False))
    return out


def write_screen(rows: Sequence[Row], result: ScreenResult, out: str | Path,
                 rates_out: str | Path | None = None) -> tuple[Path, Path]:
    """The kept rows, unchanged and in their order, to `out`; one pass-rate record per prompt to
    `rates_out` (default: `<out stem>.pass_rates.jsonl`)."""
    if len(rows) != len(result.rates):
        raise ValueError(f"{len(rows)} rows but {len(result.rates)} screened prompts")
    out = Path(out)
    rates_path = Path(rates_out) if rates_out else out.with_name(out.stem + ".pass_rates.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = original_lines(rows)
    out.write_text("".join(line + "\n" for line, keep in zip(lines, result.kept) if keep), encoding="utf-8")
    with rates_path.open("w", encoding="utf-8") as f:
        for r, keep in zip(result.rates, result.kept):
            f.write(json.dumps({"where": r.where, "pass_rate": r.pass_rate, "correct": r.correct,
                                "scored": r.scored, "kept": keep}) + "\n")
    return out, rates_path
