"""Prompts in, scored completions out: the sampling half of an online step.

With DAPO dynamic sampling (arXiv:2503.14476), groups whose rewards are all equal carry no
gradient signal; they are dropped and more prompts are drawn, up to a limit of extra rounds. The
step's reward metrics then describe the kept groups (what is trained on);
`dynamic_sampling/reward_mean_before_filter` is the mean over everything that was sampled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from rlft.algorithms import zero_variance_groups
from rlft.data.order import PromptSampler
from rlft.data.prompts import PromptExample
from rlft.errors import RankStopped, RlftError
from rlft.monitor.stats import world_sums
from rlft.rewards.scoring import RewardScorer, Scores, score_completions
from rlft.rollout.agent.environments import EpisodeRow
from rlft.rollout.agent.turns import TurnDriver, episode_metrics
from rlft.rollout.contract import Completion, Engine, SamplingParams
from rlft.training.distributed import SINGLE, World

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    examples: list[PromptExample]  # one per completion
    completions: list[Completion]
    group_ids: list[int]
    scores: Scores
    metrics: dict[str, float] = field(default_factory=dict)
    # the scorer's report of this batch (reward/timeouts, reward/errors; warning lines), taken when
    # it was scored: a sampler thread may score the next batch before the loop logs this one
    scoring_report: tuple[dict[str, float], list[str]] = field(default_factory=lambda: ({}, []))

    @property
    def rewards(self) -> list[float | None]:
        return self.scores.total


def collect_rollout(engine: Engine, sampler: PromptSampler, prompts: list[PromptExample], scorer: RewardScorer,
                    params: SamplingParams, prompts_per_step: int, dynamic_sampling: bool = False,
                    max_rounds: int = 3, world: World = SINGLE, driver: TurnDriver | None = None) -> Rollout:
    """A step's scored completions. In a distributed run every rank draws the same global prompts
    and generates its own share of them (group ids stay global: a prompt's G completions live on
    one rank). With a turn `driver` each completion is a whole multi-turn episode. Only dynamic
    sampling's rounds and metrics run collectives here; `reduce_rollout` adds the rest."""
    t_gen = t_score = 0.0
    kept: list[tuple[PromptExample, Completion, int]] = []  # (example, completion, group id)
    kept_scores: list[Scores] = []
    sampled: list[float] = []  # every verifiable total, before the filter
    rounds, dropped, next_group = 0, 0, 0
    while True:
        rounds += 1
        # round 1 keeps nothing yet, so it needs no collective: a sampler thread (async) only runs
        # round 1 (dynamic sampling, the later rounds, is refused with async_steps)
        need = prompts_per_step if rounds == 1 else \
            prompts_per_step - int(world.sum([len({g for *_, g in kept})])[0])
        first_draw = sampler.drawn
        drawn = [prompts[i] for i in sampler.take(need)]
        first, stop = world.share(len(drawn))
        chosen = drawn[first:stop]
        failed: BaseException | None = None
        try:
            start = time.perf_counter()
            if not chosen:  # called all the same: every rank's engine counts the same calls (see Engine.generate)
                completions = engine.generate([], params, first_prompt=next_group + first)
            elif driver is not None:
                rows = [EpisodeRow(e.where, e.fields, first_draw + first + j) for j, e in enumerate(chosen)]
                completions = driver.run([e.messages for e in chosen], params, first_prompt=next_group + first,
                                         rows=rows)
            else:
                completions = engine.generate([e.prompt_ids for e in chosen], params, first_prompt=next_group + first)
            t_gen += time.perf_counter() - start
            examples = [chosen[c.prompt_index] for c in completions]
            start = time.perf_counter()
            scores = score_completions(scorer, examples, completions, params.max_new_tokens)
            t_score += time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001  (on one rank alone it must stop every rank: the vote below)
            failed = exc
        if dynamic_sampling:  # its rounds run collectives: the ranks vote before the next one
            failed = first_failure(world, failed, f"sampling or scoring its share of round {rounds}")
        if failed is not None:
            raise failed
        sampled += [t for t in scores.total if t is not None]
        groups = [next_group + first + c.prompt_index for c in completions]
        next_group += len(drawn)
        keep = torch.ones(len(completions), dtype=torch.bool)
        if dynamic_sampling:
            keep = ~_flat_groups(scores.total, groups)
            dropped += len(set(g for g, k in zip(groups, keep.tolist()) if not k))
        kept_scores.append(scores.subset([i for i, k in enumerate(keep.tolist()) if k]))
        kept += [(e, c, g) for e, c, g, k in zip(examples, completions, groups, keep.tolist()) if k]
        if not dynamic_sampling or rounds > max_rounds:
            break
        if world.sum([len({g for *_, g in kept})])[0] >= prompts_per_step:
            break
    scores = Scores.concat(kept_scores)
    metrics = {"time/generate": t_gen, "time/score": t_score}
    if dynamic_sampling:
        dropped, kept_groups, sampled_sum, sampled_n = world.sum(
            [dropped, len({g for *_, g in kept}), sum(sampled), len(sampled)])
        metrics.update({"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/dropped_groups": dropped,
                        "dynamic_sampling/kept_groups": kept_groups,
                        "dynamic_sampling/reward_mean_before_filter": sampled_sum / sampled_n if sampled_n
                        else float("nan")})
    return Rollout([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept], scores, metrics)


def first_failure(world: World, own: BaseException | None, what: str) -> BaseException | None:
    """Any rank's failure of this phase as the same RankStopped on every rank (`World.agree`, a
    collective every rank calls: they all stop at the same batch, so their later collectives, the
    checkpoint's among them, stay paired; a rank that raised alone would leave the others waiting
    in the next one). One process: its own error, as it was raised."""
    if not world.active:
        return own
    reason = None
    if isinstance(own, RlftError):  # its message names the place and the fix
        reason = str(own)
    elif own is not None:  # a bug: the other ranks get its last line, this rank's log its traceback
        log.error("rank %d failed %s", world.rank, what, exc_info=own)
        reason = f"{type(own).__name__}: {own} (the traceback is in rank {world.rank}'s log)"
    agreed = world.agree(reason, what)
    return None if agreed is None else RankStopped(agreed)


def reduce_rollout(rollout: Rollout, world: World, episodes: bool) -> None:
    """The batch's metrics that need every rank (collectives), added in the loop's thread when it
    takes the batch: a sampler thread (async) computes only this rank's share. `episodes`: agent
    metrics over the step's episodes, not this rank's share."""
    if episodes:
        rollout.metrics.update(episode_metrics(rollout.completions, reduce=lambda counts: world_sums(world, counts)))


def _flat_groups(total: list[float | None], groups: list[int]) -> torch.Tensor:
    valid = torch.tensor([t is not None for t in total])
    scores = torch.tensor([t if t is not None else 0.0 for t in total], dtype=torch.float64)
    return zero_variance_groups(scores, torch.tensor(groups), valid)
