"""The `reasoning_gym` reward: a reasoning-gym task's own verifier on the completion's
`<answer>...</answer>` (rows from a `reasoning_gym:TASK` source carry the generator's entry)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable

from rlft.errors import DataError
from rlft.rewards.scoring import RewardFn, register_reward


def import_reasoning_gym() -> Any:
    """The optional extra, or one error with its install command (the data source uses it too)."""
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("reasoning-gym is not installed; install it with: pip install 'rlft[reasoning-gym]'") from None
    return reasoning_gym


@lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[..., float]:
    return import_reasoning_gym().get_score_answer_fn(task)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FALLBACKS = ("none", "last_number", "last_line")


def _fallback_answer(completion: str, fallback: str) -> str | None:
    if fallback == "last_number":
        numbers = _NUMBER.findall(completion)
        return numbers[-1] if numbers else None
    if fallback == "last_line":
        lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
        return lines[-1] if lines else None
    return None


@register_reward("reasoning_gym")
def reasoning_gym(tag: str = "answer", fallback: str = "none") -> RewardFn:
    """The task's `score_answer(answer, entry)` (0..1; most tasks give 1.0 for a right answer) on the
    text inside the last `<tag>...</tag>`. Without the tag: 0.0, or with `fallback` the completion's
    last number ('last_number', for arithmetic tasks and models that never write tags) or last
    non-empty line ('last_line').

    >>> entry = {"question": "2 + 3 =", "answer": "5", "metadata": {"source_dataset": "chain_sum"}}
    >>> reasoning_gym(fallback="last_number")("q", "The answer is 5.", rg_entry=entry)
    1.0
    >>> reasoning_gym()("q", "The answer is 5.", rg_entry=entry)  # no tag, no fallback
    0.0
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)} (got {fallback!r})")

    def reward(prompt: str, completion: str, rg_entry: dict[str, Any], **row: Any) -> float:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(completion, tag_name=tag)
        if answer is None:
            answer = _fallback_answer(completion, fallback)
        if answer is None:
            return 0.0
        task = rg_entry["metadata"]["source_dataset"]
        return float(_scorer(task)(answer=answer, entry=rg_entry))

    reward.required_fields = ("rg_entry",)
    return reward
