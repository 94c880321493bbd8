"""Held-out evaluation of tool-use episodes for the tool demo: greedy multi-turn episodes with the
calculator over the held-out prompts, each final answer scored by the `math` reward.

The demo measures its models here rather than through `rlft eval` (whose evaluations are single
turn): the same TurnDriver the GRPO run samples with, its tools and limits from the run's `agent`
section, greedy, so a problem's episode is a function of the model alone. Besides accuracy it
reports how the answers were reached, from each episode's record: the share of episodes with at
least one call, failed calls per call, turns, and accuracy split by whether the episode called,
which says whether a gain came from using the tool or from answering better without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.config import AgentConfig, LoraConfig, ModelConfig
from rlft.data.prompts import make_prompt_encoder
from rlft.data.row import Row
from rlft.data.validate import check_rows
from rlft.eval.parts import EvalParts
from rlft.models.loading import load_policy
from rlft.models.template import Messages
from rlft.rewards.math import math_reward
from rlft.rollout.contract import SamplingParams


@dataclass
class EpisodeEval:
    records: list[dict[str, Any]]  # one per problem, in order (see `record`)
    metrics: dict[str, float | None]


def record(row: dict[str, Any], completion: Any, correct: bool, formatted: bool) -> dict[str, Any]:
    """What one held-out episode did: its question, transcript after the prompt, final answer,
    whether it was right and in the expected form, and its calls (a call is 'right' when its result
    is the problem's answer)."""
    ep = completion.episode
    after = ep.messages[len(row["prompt"]):]
    results = [m["content"] for m in after if m["role"] == "tool"]
    return {"question": row["prompt"][-1]["content"], "answer": row["answer"], "final": completion.text,
            "correct": bool(correct), "formatted": formatted, "tool_calls": ep.tool_calls,
            "tool_errors": sum(ep.errors.values()), "errors": dict(ep.errors), "turns": ep.turns,
            "right_result": row["answer"] in results, "tokens": len(completion.completion_ids),
            "finish": completion.finish_reason, "transcript": after}


def summarize_episodes(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Accuracy (with its binomial s.e.), tool-call rate (episodes with >= 1 call), tool error rate
    (failed calls / calls; 0 without calls), the share of final answers in the expected form, mean
    turns, and accuracy with and without a call."""
    n = len(records)
    p = sum(r["correct"] for r in records) / n
    calls = sum(r["tool_calls"] for r in records)
    called = [r for r in records if r["tool_calls"]]
    uncalled = [r for r in records if not r["tool_calls"]]
    return {
        "accuracy": p, "accuracy_se": math.sqrt(p * (1 - p) / n), "n": n,
        "tool_call_rate": len(called) / n,
        "tool_error_rate": sum(r["tool_errors"] for r in records) / calls if calls else 0.0,
        "right_result_rate": sum(r["right_result"] for r in records) / n,  # a call returned the answer
        "format_compliance": sum(r["formatted"] for r in records) / n,
        "turns_mean": sum(r["turns"] for r in records) / n,
        "tokens_mean": sum(r["tokens"] for r in records) / n,
        # None where no episode is in the group: an accuracy of nothing is not 0
        "accuracy_with_call": sum(r["correct"] for r in called) / len(called) if called else None,
        "accuracy_without_call": sum(r["correct"] for r in uncalled) / len(uncalled) if uncalled else None,
    }


def evaluate_episodes(model: str | Path, rows: list[dict[str, Any]], agent: dict[str, Any], *,
                      max_new_tokens: int, batch_size: int = 64, seed: int = 0, device: str = "cpu",
                      format_regex: str = r"(?s).*", max_prompt_length: int = 256) -> EpisodeEval:
    """Greedy episodes of `model` on `rows` (prompt messages + `answer`) under the `agent` config
    section (tools, tools_prompt, limits), `max_new_tokens` per turn, `batch_size` episodes at once;
    a final answer is in form when `format_regex` matches all of it. The prompts are checked, with
    the tools' descriptions, against `max_prompt_length` as the training run checks them."""
    import torch


    policy = load_policy(ModelConfig(path=str(model), device=device), LoraConfig())
    encode = make_prompt_encoder(policy.tokenizer, max_prompt_length)
    examples = check_rows([Row(f"held-out[{i}]", r) for i, r in enumerate(rows)], encode, "held-out", "prompt")
    driver = EvalParts.build(policy, seed=seed, batch_size=batch_size, agent=AgentConfig(**agent),
                             prompt_sets=[examples], max_prompt_length=max_prompt_length).driver
    score = math_reward()
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    records = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            prompts: list[Messages] = [r["prompt"] for r in chunk]
            for row, done in zip(chunk, driver.run(prompts, params, first_prompt=start)):
                correct = score(row["prompt"][-1]["content"], done.text, answer=row["answer"]) == 1.0
                records.append(record(row, done, correct, bool(re.fullmatch(format_regex, done.text.strip()))))
    return EpisodeEval(records, summarize_episodes(records))
