"""The one reward both frameworks score with: cheap, deterministic, pure Python.

`digit_share` is rlft's signature (`fn(prompt, completion, **row) -> float`), referenced from the
benchmark config as `benchmarks/rewards.py:digit_share`. `trl_digit_share` is the same function
with TRL's signature (`fn(prompts, completions, **kwargs) -> list[float]`, where a conversational
completion is a list of messages). A random model rarely answers correctly, so an exact-match
reward would give all-equal groups (zero advantages); the share of digit characters varies from
sample to sample, so every step carries a real policy-gradient signal in both frameworks.
"""

from __future__ import annotations

from typing import Any


def digit_share(prompt: str, completion: str, **row: Any) -> float:
    """Share of the completion's characters that are digits (0.0 for an empty completion)."""
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion if isinstance(m.get("content"), str))
    return completion


def trl_digit_share(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [digit_share("", _text(c)) for c in completions]
