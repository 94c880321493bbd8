"""Evaluation suites: several held-out sets, each with its own rewards and sampling, run during or
after training, their metrics logged as `eval/<suite>/<metric>`.

A suite reuses `rlft.eval.generation.evaluate_prompts` (accuracy, mean reward, pass@k, format
compliance, length, truncation) and adds, from the same completions: the length's standard
deviation, maj@k over the sampled answers, and the gap between the training reward and the suite's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlft.config import EvalSuite
from rlft.data.prompts import PromptExample, make_prompt_encoder
from rlft.data.readers import read_rows
from rlft.data.validate import check_rows
from rlft.errors import ConfigError
from rlft.eval.generation import evaluate_prompts
from rlft.eval.metrics import length_stats, maj_at_k, normalize_answer
from rlft.rewards.math import HEDGE, extract_answer
from rlft.rewards.scoring import build_scorer, load_user_function


def answer_extractor(spec: str | None) -> Callable[[str], str | None] | None:
    if spec is None:
        return None
    if spec == "math":
        return lambda text: None if (a := extract_answer(text)) == HEDGE else a

    return load_user_function(spec, "eval suite answer extractor")


@dataclass
class PreparedSuite:
    suite: EvalSuite
    examples: list[PromptExample]
    scorer: Any  # RewardScorer | None
    extract: Callable[[str], str | None] | None


def prepare_suites(suites: Sequence[EvalSuite], tokenizer: Any, max_prompt_length: int,
                   on_invalid: str = "error", scoring: Any = None, agent: Any = None) -> list[PreparedSuite]:
    """Read and check every suite's rows and build its rewards once, before training starts
    (`agent`: the run's agent section, whose verifiers environment `verifiers:eval` reads)."""

    names = [s.name for s in suites]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"eval.suites: names must be unique; {dupes} appear more than once")
    out = []
    for i, s in enumerate(suites):
        scorer = build_scorer(s.rewards, scoring, where=f"eval.suites[{i}].rewards") if s.rewards else None
        encode = make_prompt_encoder(tokenizer, max_prompt_length, scorer.required_fields if scorer else ())
        examples = check_rows(read_rows(s.data, s.split, agent=agent), encode, s.data, f"eval suite '{s.name}'",
                              on_invalid)
        out.append(PreparedSuite(s, examples, scorer, answer_extractor(s.answer)))
    return out


def evaluate_suite(engine: Any, prepared: PreparedSuite, seed: int = 0, train_reward: float | None = None,
                   driver: Any = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One suite's metrics (prefixed `eval/<name>/`) and per-completion records; with a turn
    `driver`, of whole episodes under the suite's sampling settings."""
    suite = prepared.suite
    prefix = f"eval/{suite.name}/"
    result = evaluate_prompts(engine, prepared.examples, suite.eval_config(), prepared.scorer, prefix=prefix,
                              seed=seed, driver=driver)
    metrics = dict(result.metrics)
    done = result.completions
    stats = length_stats([len(c.completion_ids) for c in done], [c.finish_reason == "length" for c in done])
    metrics[f"{prefix}length_std"] = stats["length_std"]
    k = suite.sampling.num_samples
    if prepared.extract is not None and prepared.scorer is not None and k > 1:
        by_prompt: dict[int, list[tuple[str | None, bool]]] = {}
        for c, rec in zip(done, result.records):
            answer = normalize_answer(prepared.extract(c.text))
            by_prompt.setdefault(c.prompt_index, []).append((answer, bool(rec.get("correct"))))
            rec["answer"] = answer
        per_prompt = [maj_at_k([a for a, _ in v], [ok for _, ok in v], k) for v in by_prompt.values()]
        metrics[f"{prefix}maj@{k}"] = sum(per_prompt) / len(per_prompt)
    if train_reward is not None and f"{prefix}reward_mean" in metrics:
        metrics[f"{prefix}reward_gap"] = train_reward - metrics[f"{prefix}reward_mean"]
    return metrics, result.records


def run_suites(engine: Any, prepared: Sequence[PreparedSuite], step: int, total_steps: int, seed: int = 0,
               train_reward: float | None = None, default_every: int | None = None, driver: Any = None,
               ) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Run the suites due at `step` (all of them after the last step; a suite without its own
    `every` follows `default_every`): merged metrics, and the records of each suite that ran.
    `driver`: the run's turn driver (on `engine`), when its rollouts are multi-turn episodes."""
    metrics: dict[str, float] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    for p in prepared:
        if p.suite.due(step, total_steps, default_every):
            m, recs = evaluate_suite(engine, p, seed, train_reward, driver)
            metrics.update(m)
            records[p.suite.name] = recs
    return metrics, records
