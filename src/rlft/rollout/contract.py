"""The rollout contract: every engine returns `Completion`s, so the loop never cares which ran."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]  # the sampled ids, used for training as they are (never re-encoded)
    text: str  # decoded completion without special tokens (an episode: its last assistant turn)
    logprobs: list[float]  # per completion token, under the (temperature-scaled) sampling distribution
    finish_reason: FinishReason  # 'stop': end-of-turn / EOS / stop string; 'length': max_new_tokens
    prompt_index: int  # which prompt of the request this completion answers
    # Per completion token: 1 = sampled by the policy (trained on), 0 = inserted text (a tool's or
    # an environment's observation: attended to, never a target). None: every token was sampled.
    loss_mask: list[int] | None = None
    episode: "Episode | None" = None  # a multi-turn rollout's record (rollout/turns.py); None: one turn
    # The weights it was sampled from: how many rollout batches the trainer had trained on (set by
    # the online loop's rollout source; None outside training). Staleness = batches trained since.
    policy_version: int | None = None

    @property
    def mask(self) -> list[int]:
        return [1] * len(self.completion_ids) if self.loss_mask is None else self.loss_mask


@dataclass
class Episode:
    """What happened in one multi-turn episode, for rewards and metrics."""

    messages: list[dict[str, Any]]  # the whole transcript: the prompt conversation, then assistant / tool turns
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0  # calls parsed (well-formed or not)
    errors: dict[str, int] = field(default_factory=dict)  # failed calls by kind (see rollout/tools.py)
    tool_tokens: int = 0  # inserted (loss-masked) tokens
    budget_truncated: bool = False  # an observation would have overflowed agent.max_total_tokens
    max_turns_reached: bool = False  # the last allowed turn still asked for tools
    tool_latency_s: list[float] = field(default_factory=list)  # per call
    max_tokens: int = 0  # the episode's token budget (what `max_new_tokens` is to one turn)
    retokenize_drift: int | None = None  # trained tokens after the first one a re-render differs at (None: unchecked)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()


class Engine(Protocol):
    """What the training loop and the evaluations use of an engine."""

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0) -> list[Completion]:
        """n completions per prompt, grouped by prompt: [p0 c0..c(n-1), p1 c0.., ...]. `first_prompt`:
        the global index of prompts[0] (a rank's share of a step's prompts), which names the
        sampling streams, so completion k of a prompt is the same wherever it is generated."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the trainer's current weights (after an optimizer step)."""
        ...

    def isolated_rng(self, seed: int) -> AbstractContextManager[None]:
        """Sample from a stream seeded with `seed` inside the block, then continue the training
        stream where it was: evaluations are reproducible and never change a run's trajectory."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The sampling stream's position, for exact resume."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Free what the engine holds beyond the trainer's model (a vLLM engine's KV cache)."""
        ...
