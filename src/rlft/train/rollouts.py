"""Prompts in, scored completions out: the sampling half of an online step.

With DAPO dynamic sampling (arXiv:2503.14476), groups whose rewards are all equal carry no
gradient signal; they are dropped and more prompts are drawn, up to a limit of extra rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlft.algorithms import zero_variance_groups
from rlft.data.prompts import PromptExample
from rlft.rewards.base import RewardScorer, Scores, scoring_row
from rlft.rollout.base import Completion, Engine, SamplingParams


class PromptSampler:
    """Seeded epochs of shuffled prompts; its position is checkpointed for exact resume."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            grab = order[self.index:self.index + (k - len(out))]
            out += grab
            self.index += len(grab)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


@dataclass
class Rollout:
    examples: list[PromptExample]  # one per completion
    completions: list[Completion]
    group_ids: list[int]
    scores: Scores
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float | None]:
        return self.scores.total


def _score(scorer: RewardScorer, examples: list[PromptExample], completions: list[Completion],
           max_new_tokens: int) -> Scores:
    rows = [scoring_row(e.fields, c.finish_reason, len(c.completion_ids), max_new_tokens)
            for e, c in zip(examples, completions)]
    return scorer.score([e.prompt_text for e in examples], [c.text for c in completions], rows)


def collect_rollout(engine: Engine, sampler: PromptSampler, prompts: list[PromptExample], scorer: RewardScorer,
                    params: SamplingParams, prompts_per_step: int, dynamic_sampling: bool = False,
                    max_rounds: int = 3) -> Rollout:
    t_gen = t_score = 0.0
    kept: list[tuple[PromptExample, Completion, int]] = []  # (example, completion, group id)
    kept_scores: list[Scores] = []
    rounds, dropped, next_group = 0, 0, 0
    while True:
        rounds += 1
        need = prompts_per_step - len({g for *_, g in kept})
        chosen = [prompts[i] for i in sampler.take(need)]
        start = time.perf_counter()
        completions = engine.generate([e.prompt_ids for e in chosen], params)
        t_gen += time.perf_counter() - start
        examples = [chosen[c.prompt_index] for c in completions]
        start = time.perf_counter()
        scores = _score(scorer, examples, completions, params.max_new_tokens)
        t_score += time.perf_counter() - start
        groups = [next_group + c.prompt_index for c in completions]
        next_group += len(chosen)
        keep = torch.ones(len(completions), dtype=torch.bool)
        if dynamic_sampling:
            keep = ~_flat_groups(scores.total, groups)
            dropped += len(set(g for g, k in zip(groups, keep.tolist()) if not k))
        kept_scores.append(_subset(scores, keep.tolist()))
        kept += [(e, c, g) for e, c, g, k in zip(examples, completions, groups, keep.tolist()) if k]
        if not dynamic_sampling or len({g for *_, g in kept}) >= prompts_per_step or rounds > max_rounds:
            break
    scores = _concat(kept_scores)
    metrics = {"time/generate": t_gen, "time/score": t_score}
    if dynamic_sampling:
        metrics.update({"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/dropped_groups": float(dropped),
                        "dynamic_sampling/kept_groups": float(len({g for *_, g in kept}))})
    return Rollout([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept], scores, metrics)


def _flat_groups(total: list[float | None], groups: list[int]) -> torch.Tensor:
    valid = torch.tensor([t is not None for t in total])
    scores = torch.tensor([t if t is not None else 0.0 for t in total], dtype=torch.float64)
    return zero_variance_groups(scores, torch.tensor(groups), valid)


def _subset(scores: Scores, keep: list[bool]) -> Scores:
    pick = [i for i, k in enumerate(keep) if k]
    return Scores([scores.total[i] for i in pick], {k: [v[i] for i in pick] for k, v in scores.components.items()})


def _concat(parts: list[Scores]) -> Scores:
    total: list[Any] = []
    comps: dict[str, list[Any]] = {}
    for s in parts:
        total += s.total
        for k, v in s.components.items():
            comps.setdefault(k, []).extend(v)
    return Scores(total, comps)
