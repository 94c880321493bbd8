"""The `reasoning_gym` reward: a reasoning-gym task's own verifier on the completion's
`<answer>...</answer>` (rows from a `reasoning_gym:TASK` source carry the generator's entry)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from rlft.rewards.scoring import RewardFn, register_reward


@lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[..., float]:
    from rlft.data.reasoning_gym import _module

    return _module().get_score_answer_fn(task)


@register_reward("reasoning_gym")
def reasoning_gym(tag: str = "answer") -> RewardFn:
    """The task's `score_answer(answer, entry)` (0..1; most tasks give 1.0 for a right answer) on the
    text inside the last `<tag>...</tag>`; 0.0 when the completion has no such tag."""

    def reward(prompt: str, completion: str, rg_entry: dict[str, Any], **row: Any) -> float:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(completion, tag_name=tag)
        if answer is None:
            return 0.0
        task = rg_entry["metadata"]["source_dataset"]
        return float(_scorer(task)(answer=answer, entry=rg_entry))

    reward.required_fields = ("rg_entry",)
    return reward
