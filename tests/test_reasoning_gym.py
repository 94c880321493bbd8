"""reasoning-gym tasks as a data source and a reward: generated splits that never share a question,
the task's own verifier as the reward, clear errors for unknown tasks and settings."""

from __future__ import annotations

import json

import pytest

from rlft.api import train
from rlft.config import load_config
from rlft.data.readers import read_rows
from rlft.errors import DataError
from rlft.rewards.gym import reasoning_gym

SOURCE = "reasoning_gym:chain_sum?size=60&eval_size=20&seed=3&min_terms=2&max_terms=2&max_digits=2"


def _questions(rows):
    return [r.data["messages"][-1]["content"] for r in rows]


def test_train_and_held_out_splits_are_generated_disjoint_and_reproducible():
    train_rows, test_rows = read_rows(SOURCE, "train"), read_rows(SOURCE, "test")
    assert len(train_rows) == 60 and len(test_rows) == 20
    assert not set(_questions(train_rows)) & set(_questions(test_rows))
    assert _questions(read_rows(SOURCE, "test")) == _questions(test_rows)  # a function of the location
    assert _questions(read_rows(SOURCE.replace("seed=3", "seed=4"), "train")) != _questions(train_rows)
    row = train_rows[0]
    assert row.where == "reasoning_gym:chain_sum[train]#0"
    assert row.data["messages"][0]["role"] == "system" and "<answer>" in row.data["messages"][0]["content"]
    assert row.data["rg_entry"]["metadata"]["source_dataset"] == "chain_sum"


def test_the_reward_is_the_tasks_own_verifier_on_the_answer_tag():
    entry = read_rows(SOURCE, "train")[0].data
    reward = reasoning_gym()
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert reward("q", f"Adding up. <answer>{right}</answer>", rg_entry=entry["rg_entry"]) == 1.0
    assert reward("q", f"<answer>{wrong}</answer>", rg_entry=entry["rg_entry"]) == 0.0
    assert reward("q", right, rg_entry=entry["rg_entry"]) == 0.0  # no tag: not an answer
    assert reward.required_fields == ("rg_entry",)
    # a model that never writes tags: its last number, or its last line, by choice
    by_number = reasoning_gym(fallback="last_number")
    assert by_number("q", f"It is {wrong}, no: {right}.", rg_entry=entry["rg_entry"]) == 1.0
    assert by_number("q", f"<answer>{wrong}</answer> {right}", rg_entry=entry["rg_entry"]) == 0.0  # the tag wins
    assert reasoning_gym(fallback="last_line")("q", f"Sum:\n{right}\n", rg_entry=entry["rg_entry"]) == 1.0
    with pytest.raises(ValueError, match="fallback must be one of none, last_number, last_line"):
        reasoning_gym(fallback="first_number")


def test_the_system_prompt_is_a_setting_of_the_location():
    plain = read_rows(SOURCE + "&system=none", "train")[0].data["messages"]
    assert [m["role"] for m in plain] == ["user"]
    direct = read_rows(SOURCE + "&system=direct", "train")[0].data["messages"]
    assert direct[0]["role"] == "system" and "directly" in direct[0]["content"]


@pytest.mark.parametrize("source, split, why", [
    ("reasoning_gym:no_such_task", "train", "unknown reasoning-gym task 'no_such_task'. Valid tasks: ab, "),
    ("reasoning_gym:chain_sum?difficulty=9", "train", "chain_sum has no setting 'difficulty'; its settings: "),
    ("reasoning_gym:chain_sum?size=0", "train", "size=0 must be a whole number >= 1"),
    ("reasoning_gym:chain_sum?min_terms=5&max_terms=2", "train", "chain_sum refused its settings"),
    ("reasoning_gym:chain_sum", "validation", "splits 'train' (data.split) and 'test'"),
    ("reasoning_gym:chain_sum?system=chatty", "train", "system='chatty' is not one of reasoning-gym's system prompts"),
    # one-digit a + b / a - b: about 200 questions exist, 400 train rows cover nearly all of them
    ("reasoning_gym:chain_sum?size=400&eval_size=100&min_terms=2&max_terms=2&max_digits=1", "test",
     "held-out questions differ from the 400 train ones"),
])
def test_bad_locations_are_one_clear_error(source, split, why):
    with pytest.raises(DataError) as info:
        read_rows(source, split)
    assert why in str(info.value)


def test_grpo_on_a_generated_task_evaluates_on_its_held_out_rows(tmp_path, qwen_path):
    cfg = {"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0, "model": {"path": str(qwen_path)},
           "data": {"train": SOURCE, "eval": SOURCE},
           "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "eval_every": 2},
           "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8},
           "eval": {"max_examples": 4, "max_new_tokens": 8},
           "rewards": [{"fn": "reasoning_gym"}], "logging": {"progress": False}}
    assert load_config(cfg).data.eval_split == "test"  # the held-out rows, not the train ones
    assert train(cfg)["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reward/reasoning_gym" in rows[0] and "eval/accuracy" in rows[-1]
