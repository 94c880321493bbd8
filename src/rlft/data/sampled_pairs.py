"""Preference pairs sampled from a model: N completions per prompt, scored, best vs worst.

For each prompt: sample N completions, score each (a reward function's value or a reward model's
score; None = could not be scored), and keep the best-scored completion as `chosen` and the
worst-scored as `rejected` when their gap exceeds `margin`. Rows come out in rlft's preference
format (`rlft.data.pairs`): `{"prompt", "chosen", "rejected", "margin"}`, where `margin` is the
score gap (reward-model training reads it as the pair's Bradley-Terry margin).

A prompt is skipped, and counted, when fewer than two completions could be scored, when the gap is
not above the margin (every completion about as good: no preference to learn), or when the best
and worst texts are identical.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from rlft.data.prompts import PromptExample
from rlft.data.screen import Sampler, _text

# score(example, completion texts) -> one score per completion (None: unscorable)
BatchScore = Callable[[PromptExample, list[str]], Sequence["float | None"]]


@dataclass
class PairCounts:
    prompts: int = 0
    pairs: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"unscored": 0, "small_gap": 0, "identical": 0})

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def best_and_worst(scores: Sequence[float | None]) -> tuple[int, int] | None:
    """Indices of the highest and lowest score (the first of equals); None if fewer than two scored."""
    scored = [i for i, s in enumerate(scores) if s is not None]
    if len(scored) < 2:
        return None
    best = max(scored, key=lambda i: (scores[i], -i))
    worst = min(scored, key=lambda i: (scores[i], i))
    return best, worst


def prompt_field(example: PromptExample) -> str | list[dict[str, str]]:
    """The prompt as a plain string for a one-user-turn conversation, else its messages."""
    msgs = example.messages
    if len(msgs) == 1 and msgs[0]["role"] == "user":
        return msgs[0]["content"]
    return msgs


def pair_for_prompt(example: PromptExample, texts: Sequence[str], scores: Sequence[float | None],
                    margin: float, counts: PairCounts) -> dict[str, Any] | None:
    counts.prompts += 1
    picked = best_and_worst(scores)
    if picked is None:
        counts.skipped["unscored"] += 1
        return None
    best, worst = picked
    gap = float(scores[best]) - float(scores[worst])
    if not gap > margin:
        counts.skipped["small_gap"] += 1
        return None
    if texts[best] == texts[worst]:
        counts.skipped["identical"] += 1
        return None
    counts.pairs += 1
    return {"prompt": prompt_field(example), "chosen": texts[best], "rejected": texts[worst], "margin": gap}


def sample_pairs(examples: Sequence[PromptExample], sample: Sampler, score: BatchScore, n: int = 8,
                 margin: float = 0.0, batch_prompts: int = 64) -> tuple[list[dict[str, Any]], PairCounts]:
    """Preference rows for the prompts that yield a clear best and worst of n samples."""
    if n < 2:
        raise ValueError(f"pairs need at least 2 samples per prompt, got {n}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    rows: list[dict[str, Any]] = []
    counts = PairCounts()
    for start in range(0, len(examples), batch_prompts):
        chunk = list(examples[start:start + batch_prompts])
        completions = list(sample(chunk, n))
        if len(completions) != n * len(chunk):
            raise ValueError(f"the sampler returned {len(completions)} completions for {len(chunk)} prompts x {n}")
        for i, example in enumerate(chunk):
            texts = [_text(c) for c in completions[i * n:(i + 1) * n]]
            scores = list(score(example, texts))
            if len(scores) != n:
                raise ValueError(f"the scorer returned {len(scores)} scores for {n} completions")
            row = pair_for_prompt(example, texts, scores, margin, counts)
            if row is not None:
                rows.append(row)
    return rows, counts


def write_pairs(rows: Sequence[dict[str, Any]], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return out
