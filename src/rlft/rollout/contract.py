"""The rollout contract: every engine returns `Completion`s, so the loop never cares which ran."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

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
    episode: "Episode | None" = None  # a multi-turn rollout's record (rollout/agent/turns.py); None: one turn
    # The weights it was sampled from: how many rollout batches the trainer had trained on (set by
    # the online loop's rollout source; None outside training). Staleness = batches trained since.
    policy_version: int | None = None

    @property
    def mask(self) -> list[int]:
        return [1] * len(self.completion_ids) if self.loss_mask is None else self.loss_mask


def trained_segments(completion: Completion, decode: Callable[[list[int]], str],
                     transcript: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The completion as runs of equal loss mask, each decoded on its own (special tokens kept, so
    the template's markers show): [{"role", "text", "trained"}], whose texts add up to the whole.
    A trained run is an assistant turn. An inserted run is named by the roles of the messages it
    holds: observations go in as ids and messages together, so the k-th inserted run is the k-th
    group of non-assistant messages in `transcript` (the episode's messages after the prompt)."""
    groups: list[list[str]] = []
    for m in transcript:
        if m["role"] == "assistant":
            groups.append([])
        elif groups:
            groups[-1].append(m["role"])
    inserted = ["/".join(dict.fromkeys(g)) for g in groups if g]
    ids, mask = completion.completion_ids, completion.mask
    segments: list[dict[str, Any]] = []
    start = k = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and mask[end] == mask[start]:
            continue  # the run goes on
        if mask[start]:
            role = "assistant"
        else:
            role, k = (inserted[k] if k < len(inserted) else "inserted"), k + 1
        segments.append({"role": role, "text": decode(ids[start:end]), "trained": bool(mask[start])})
        start = end
    return segments


@dataclass
class Episode:
    """What happened in one multi-turn episode, for rewards and metrics."""

    messages: list[dict[str, Any]]  # the whole transcript: the prompt conversation, then assistant / tool / user turns
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0  # calls parsed (well-formed or not)
    errors: dict[str, int] = field(default_factory=dict)  # failed calls by kind (see rollout/agent/tools.py)
    tool_tokens: int = 0  # inserted (loss-masked) tokens
    budget_truncated: bool = False  # an observation would have overflowed agent.max_total_tokens
    max_turns_reached: bool = False  # the last allowed turn still asked for tools, or its environment was not done
    ended_on_error: bool = False  # a call failed and agent.on_tool_error is 'end'
    tool_latency_s: list[float] = field(default_factory=list)  # per call
    max_tokens: int = 0  # the episode's token budget (what `max_new_tokens` is to one turn)
    retokenize_drift: int | None = None  # trained tokens after the first one a re-render differs at (None: unchecked)
    # with an environment (rollout/agent/environments.py); env_rewards is None without one
    env_rewards: list[float] | None = None  # per step, in order
    env_done: bool = False  # the environment ended the episode (not a turn or token limit)
    env_tokens: int = 0  # inserted (loss-masked) observation tokens
    env_final: str | None = None  # the last step's observation when it was not shown (the episode ended there)
    env_timed_out: bool = False  # a step did not return within agent.env_step_timeout_s (the episode ended there)
    # with agent.program (rollout/agent/program.py): what the program returned, and the times a call's
    # prompt did not extend the previous call's (the episode then trains as several exact sequences)
    program_reward: Any = None
    program_ok: bool | None = None  # None: not a program's episode; False: it raised, timed out or never called
    prefix_breaks: int = 0


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

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0,
                 streams: Sequence[str] | None = None) -> list[Completion]:
        """n completions per prompt, grouped by prompt: [p0 c0..c(n-1), p1 c0.., ...]. A prompt is
        token ids, used as they are (a later turn's context: the episode so far, never re-encoded).
        Each completion draws from its own sampling stream, so it is the same wherever it is generated:
        - streams=None, a new request: completion k of prompts[i] draws from stream
          (first_prompt + i) * n + k of a new call; `first_prompt` is the global index of prompts[0]
          (a rank's share of a step's prompts);
        - streams given (one name per prompt), a later turn of the last request's episodes:
          completion k of prompts[i] draws from the stream named (streams[i], k) within the last
          call, which this one continues (the call counter stays). A turn then depends on its
          episode's name alone: not on the episodes sharing the call, how many turns they take,
          or the rank that runs them; and a step costs one call however many turns it takes."""
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
