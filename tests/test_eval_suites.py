"""Eval suites on a scripted engine: every metric under eval/<suite>/, values computed by hand."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from rlft.errors import ConfigError
from rlft.config import EvalSuite
from rlft.eval.suites import prepare_suites, run_suites
from rlft.rollout.contract import Completion

# completions per prompt (4 samples each); sample j has j + 1 tokens and sample 3 hits the length limit
SCRIPT = [
    ["the answer is 7", "the answer is 7", "the answer is 3", "no idea"],  # gold 7: 2 correct, vote 7
    ["the answer is 2", "the answer is 2", "the answer is 5", "the answer is 2"],  # gold 5: 1 correct, vote 2
    ["the answer is 9"] * 4,  # gold 9: 4 correct
]


class ScriptedEngine:
    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for i, ids in enumerate(prompts):
            for j in range(params.n):
                out.append(Completion(prompt_ids=ids, completion_ids=list(range(j + 1)), text=SCRIPT[i][j],
                                      logprobs=[0.0] * (j + 1), finish_reason="length" if j == 3 else "stop",
                                      prompt_index=i))
        return out


@pytest.fixture(scope="module")
def tokenizer(qwen_path):
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(qwen_path)))


@pytest.fixture
def suite_file(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "answer": a}) + "\n"
                            for i, a in enumerate(["7", "5", "9"])))
    return path


def make_suite(path, **extra) -> EvalSuite:
    return EvalSuite.model_validate({"name": "math", "data": str(path), "rewards": [{"fn": "math"}],
                                     "sampling": {"num_samples": 4, "temperature": 1.0, "max_new_tokens": 8},
                                     "format_regex": r"the answer is \d+", **extra})


def test_suite_metrics_by_hand(tokenizer, suite_file):
    prepared = prepare_suites([make_suite(suite_file)], tokenizer, max_prompt_length=64)
    metrics, records = run_suites(ScriptedEngine(), prepared, step=10, total_steps=10, train_reward=0.75)
    m = {k.removeprefix("eval/math/"): v for k, v in metrics.items()}
    assert all(k.startswith("eval/math/") for k in metrics)
    assert m["accuracy"] == pytest.approx(7 / 12)  # 2 + 1 + 4 of 12 samples
    assert m["pass@1"] == pytest.approx(7 / 12)
    assert m["pass@4"] == 1.0  # every prompt has a correct sample
    assert m["maj@4"] == pytest.approx(2 / 3)  # votes: 7 (right), 2 (wrong), 9 (right)
    assert m["reward_mean"] == pytest.approx(7 / 12)
    assert m["reward_gap"] == pytest.approx(0.75 - 7 / 12)
    # lengths 1, 2, 3, 4 per prompt: mean 2.5, std sqrt(1.25); sample 3 of each prompt truncated
    assert m["length_mean"] == 2.5 and m["length_std"] == pytest.approx(math.sqrt(1.25))
    assert m["truncation_rate"] == 0.25
    # compliant: stopped and fully matching -> samples 0-2 of prompts 0 and 1 ("no idea" is sample 3), 0-2 of 2
    assert m["format_compliance"] == pytest.approx(9 / 12)
    assert len(records["math"]) == 12 and records["math"][2]["answer"] == "3"


def test_suites_run_when_due(tokenizer, suite_file):
    every2 = make_suite(suite_file, name="every2", every=2)
    final = make_suite(suite_file, name="final", answer=None)
    prepared = prepare_suites([every2, final], tokenizer, max_prompt_length=64)
    engine = ScriptedEngine()
    metrics, _ = run_suites(engine, prepared, step=1, total_steps=5)
    assert metrics == {} and engine.calls == 0
    metrics, _ = run_suites(engine, prepared, step=2, total_steps=5)
    assert {k.split("/")[1] for k in metrics} == {"every2"}
    metrics, _ = run_suites(engine, prepared, step=5, total_steps=5)  # the last step runs every suite
    assert {k.split("/")[1] for k in metrics} == {"every2", "final"}
    assert "eval/final/maj@4" not in metrics and "eval/every2/maj@4" in metrics  # answer: null -> no maj@k


def test_suite_settings_are_checked(tokenizer, suite_file):
    with pytest.raises(ValidationError, match="letters, digits"):
        make_suite(suite_file, name="my suite")
    with pytest.raises(ValidationError, match="extra"):
        make_suite(suite_file, samples=3)
    with pytest.raises(ConfigError, match="unique"):
        prepare_suites([make_suite(suite_file), make_suite(suite_file)], tokenizer, 64)
    assert make_suite(suite_file).eval_config().num_samples == 4
