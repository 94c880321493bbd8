"""Generation-based evaluation: accuracy, mean reward, pass@k, format compliance, lengths."""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlft.config import EvalConfig
from rlft.data.prompts import PromptExample
from rlft.rewards.scoring import RewardScorer, score_completions
from rlft.rollout.agent.environments import EpisodeRow
from rlft.rollout.agent.turns import TurnDriver, episode_metrics
from rlft.rollout.contract import Completion, Engine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, arXiv:2107.03374):
    1 - C(n-c, k) / C(n, k), computed as a stable product.

    >>> round(pass_at_k(4, 1, 2), 4)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass
class EvalResult:
    metrics: dict[str, float]
    records: list[dict[str, Any]]
    completions: list[Completion] = field(default_factory=list)  # one per record, in order


def is_format_compliant(completion: Completion, pattern: re.Pattern | None) -> bool:
    if completion.finish_reason != "stop":
        return False
    return pattern is None or pattern.fullmatch(completion.text.strip()) is not None


def sample_answers(engine: Engine, examples: Sequence[PromptExample], cfg: EvalConfig, seed: int = 0,
                   driver: TurnDriver | None = None) -> tuple[list[PromptExample], list[Completion]]:
    """The first `cfg.max_examples` examples and `cfg.num_samples` completions of each, grouped by
    prompt, sampled under the eval settings from `seed` (the engine's own generator is untouched).
    With a turn `driver` each completion is a whole episode, every turn sampled on `engine` under
    the eval settings and the agent's tools and limits."""
    examples = list(examples)[: cfg.max_examples] if cfg.max_examples else list(examples)
    params = SamplingParams(n=cfg.num_samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    isolated = getattr(engine, "isolated_rng", None)  # keep the rollout generator untouched
    with isolated(seed) if isolated else nullcontext():
        if driver is None:
            completions = engine.generate([e.prompt_ids for e in examples], params)
        else:  # an environment starts from each row (seeded by its place in the eval set: the same every eval)
            rows = [EpisodeRow(e.where, e.fields, i) for i, e in enumerate(examples)]
            completions = driver.run([e.messages for e in examples], params, rows=rows, engine=engine)
    return examples, completions


def evaluate_prompts(engine: Engine, examples: Sequence[PromptExample], cfg: EvalConfig,
                     scorer: RewardScorer | None = None, prefix: str = "eval/", seed: int = 0,
                     driver: TurnDriver | None = None) -> EvalResult:
    """Generation metrics of `examples` (with a `driver`: of episodes, plus the agent's metrics
    under `<prefix>agent/`: tool calls per episode, tool error rate, ...)."""
    examples, completions = sample_answers(engine, examples, cfg, seed, driver)
    pattern = re.compile(cfg.format_regex) if cfg.format_regex else None
    fmt = [is_format_compliant(c, pattern) for c in completions]
    lengths = [len(c.completion_ids) for c in completions]
    m: dict[str, float] = {
        f"{prefix}format_compliance": sum(fmt) / len(fmt),
        f"{prefix}length_mean": sum(lengths) / len(lengths),
        f"{prefix}truncation_rate": sum(c.finish_reason == "length" for c in completions) / len(completions),
        f"{prefix}num_prompts": float(len(examples)),
    }
    records = [{"where": examples[c.prompt_index].where, "prompt": examples[c.prompt_index].prompt_text,
                "completion": c.text, "finish_reason": c.finish_reason, "format_ok": ok}
               for c, ok in zip(completions, fmt)]
    if driver is not None:
        m.update({prefix + key: value for key, value in episode_metrics(completions).items()})
        for rec, c in zip(records, completions):  # the episode after its prompt: assistant and tool turns
            rec.update(transcript=c.episode.messages[len(examples[c.prompt_index].messages):],
                       turns=c.episode.turns, tool_calls=c.episode.tool_calls)
    if scorer is not None:
        _add_reward_metrics(m, records, examples, completions, scorer, cfg, prefix)
    return EvalResult(m, records, completions)


def _add_reward_metrics(m, records, examples, completions, scorer, cfg, prefix) -> None:
    scores = score_completions(scorer, [examples[c.prompt_index] for c in completions], completions,
                               cfg.max_new_tokens)
    name = cfg.correct_component or scorer.components[0][0]
    if name not in scores.components:
        raise ValueError(f"eval.correct_component {name!r} is not a reward component "
                         f"({', '.join(scores.components)})")
    correct = [v is not None and v >= cfg.correct_threshold for v in scores.components[name]]
    valid = [t for t in scores.total if t is not None]
    m[f"{prefix}reward_mean"] = sum(valid) / len(valid) if valid else float("nan")
    m[f"{prefix}accuracy"] = sum(correct) / len(correct)
    k = cfg.num_samples
    if k > 1:
        per_prompt: dict[int, list[bool]] = {}
        for c, ok in zip(completions, correct):
            per_prompt.setdefault(c.prompt_index, []).append(ok)
        for kk in sorted({1, k}):
            m[f"{prefix}pass@{kk}"] = sum(pass_at_k(len(v), sum(v), kk) for v in per_prompt.values()) / len(per_prompt)
    for i, (rec, total, ok) in enumerate(zip(records, scores.total, correct)):
        rec["reward"], rec["correct"] = total, ok
        if scores.info:  # notes of rewards (a judge's reply, an ensemble's members)
            rec["info"] = scores.sample_info(i)
