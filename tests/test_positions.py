"""Sequences longer than the model has positions for (issue "Hard to misuse, round 4", item 7): the
tiny model has 1,024 (max_position_embeddings in its config.json). Before, `rollout.max_new_tokens=2000`
trained without a word and, at 100,000, the memory plan's suggested fix was to halve the length to
about 50,000 tokens "(fits)": a length the model cannot hold either."""

from __future__ import annotations

import pytest
import transformers
import yaml

from conftest import assert_clean_user_error, make_config, run_main, write_jsonl


@pytest.fixture
def grpo_config(tmp_path, qwen_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)}
                                                       for i in range(4)])
    cfg = make_config(qwen_path, prompts, tmp_path / "run", method="grpo", rewards=[{"fn": "math"}],
                      data={"train": str(prompts)},
                      rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8},
                      training={"max_steps": 1, "num_threads": 1})
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any weights fails the test: every check here must come first."""
    def fail(*args, **kwargs):
        pytest.fail("the weights were loaded before the lengths were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)


@pytest.mark.parametrize("command", ["train", "plan"])
def test_new_tokens_past_the_models_positions_stop_train_and_plan(command, grpo_config, no_weights,
                                                                  monkeypatch, capsys):
    extra = ["--memory-gb", "8"] if command == "plan" else []
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, command, str(grpo_config),
                                              "rollout.max_new_tokens=2000", *extra))
    said = " ".join(stderr.split())  # the console's line wrapping undone
    assert "rollout.max_new_tokens=2000" in said and "the longest prompt in the data" in said
    assert "more than the model's 1024 positions (max_position_embeddings in" in said
    prompt = int(said.split("the longest prompt in the data (")[1].split(" tokens)")[0])
    assert f"Fix: rollout.max_new_tokens={1024 - prompt} or less" in said
    # one token less than the room left fits: the same command passes the check
    if command == "plan":
        done = run_main(monkeypatch, capsys, "plan", str(grpo_config), f"rollout.max_new_tokens={1024 - prompt}",
                        "--memory-gb", "8")
        assert done.returncode == 0, done.stdout + done.stderr


def test_without_readable_data_the_prompt_limit_counts(grpo_config, no_weights, monkeypatch, capsys):
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "plan", str(grpo_config),
                                              "data.train=missing.jsonl", "rollout.max_new_tokens=600"))
    said = " ".join(stderr.split())
    assert "data.max_prompt_length=512 + rollout.max_new_tokens=600 = 1112 tokens per sequence" in said
    assert "Fix: rollout.max_new_tokens=512 or less, or a lower data.max_prompt_length" in said


def test_a_huge_max_new_tokens_gets_no_fix_past_the_positions(grpo_config, no_weights, monkeypatch, capsys):
    """Before: 'max length 100016 -> 50008 tokens (fits)' as the plan's suggested change."""
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "plan", str(grpo_config),
                                              "rollout.max_new_tokens=100000", "--memory-gb", "1"))
    said = " ".join(stderr.split())
    assert "rollout.max_new_tokens=100000" in said and "1024 positions" in said and "(fits)" not in said


def test_the_agent_budget_and_the_offline_length_are_checked(grpo_config, no_weights, monkeypatch, capsys):
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(grpo_config),
                                              "agent.tools=[calculator]", "agent.max_total_tokens=1024"))
    said = " ".join(stderr.split())
    assert "+ agent.max_total_tokens=1024 =" in said and "Fix: agent.max_total_tokens=" in said
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(grpo_config), "method=sft",
                                              "rewards=[]", "data.max_length=2048"))
    said = " ".join(stderr.split())
    assert "data.max_length=2048 is more than the model's 1024 positions" in said
    assert "Fix: data.max_length=1024 or less" in said


def test_advice_never_suggests_a_length_past_the_positions():
    from rlft.plan.advice import advise
    from rlft.plan.memory import PlanInput

    model = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024}
    setting = PlanInput(method="online", micro_batch_size=8, batch_size=8, seq_len=100_016, completion_len=100_000,
                        group_size=8, prompts_per_step=1)
    lengths = [a.change for a in advise(model, setting, 2**30) if a.change.startswith("max length")]
    assert lengths == ["max length 100016 -> 1024 tokens"]
