"""A run that will learn nothing says so on the console within its first steps, naming the cause it
can see, once, and records it in events.jsonl (round 4 of the misuse issue, item 4): every tool call
fails (raises, times out, returns no text), every reward is equal (no variance in any group), every
completion is cut at the length limit.

Before: a tool failing on every call showed only as agent/tool_error_rate 1.0 in metrics.jsonl, and
the console's one word on it came at the end ("no optimizer step ... check that the reward can
tell completions apart"); all-equal rewards were warned about after 5 steps, all-cut completions
after 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_model import prompt_rows
from conftest import write_jsonl

TOOLS = '''
import time


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers and operators, e.g. "1 + 2".
    """
    {body}
'''

BODIES = {"raised": 'raise RuntimeError("the calculator service is down")',
          "timeout": 'time.sleep(3)\n    return "late"',
          "bad_result": "return None"}

CONSTANT = '''
def constant(prompt, completion, **row):
    return 0.0
'''


def _said(capsys) -> str:
    """What the console printed, its line wrapping undone."""
    out = capsys.readouterr()
    return " ".join((out.out + out.err).split())


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("kind", list(BODIES))
def test_a_tool_that_fails_on_every_call_is_said_at_step_2_once(kind, calculator_path, tmp_path, capsys,
                                                                monkeypatch):
    """The calculator model calls `calculator` in its first turn; here that tool always fails."""
    from rlft.api import train

    monkeypatch.setenv("COLUMNS", "250")
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS.replace("{body}", BODIES[kind]))
    run = tmp_path / "run"
    cfg = {"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(calculator_path)},
           "data": {"train": str(write_jsonl(tmp_path / "sums.jsonl", prompt_rows()))},
           "training": {"learning_rate": 1e-7, "max_steps": 3, "num_threads": 1, "precision": "fp32"},
           # a low temperature: every episode's first turn is the call the model was trained to make
           "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 80, "temperature": 0.3},
           "rewards": [{"fn": "math"}],
           "agent": {"tools": [f"{tools}:calculator"], "max_turns": 2, "max_total_tokens": 160,
                     "tool_timeout_s": 0.2},
           "logging": {"progress": False}}
    assert train(cfg)["status"] == "completed"
    said = _said(capsys)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent/tool_error_rate"] for r in rows] == [1.0, 1.0, 1.0]
    line = f"warn: tool_errors at step 2: every tool call failed in each of the last 2 steps ({kind}: "
    assert said.count("warn: tool_errors") == 1 and line in said, said
    fix = {"raised": "call it by hand", "timeout": "agent.tool_timeout_s", "bad_result": "return a str"}[kind]
    assert fix in said.split(line, 1)[1].split("warn:", 1)[0]
    [event] = [e for e in _events(run) if e["detector"] == "tool_errors"]
    assert event["step"] == 2 and event["action"] == "warn" and event["values"][f"errors/{kind}"] >= 2
    assert event["message"].startswith("every tool call failed in each of the last 2 steps")


def test_equal_rewards_and_cut_completions_are_said_at_step_2_once_each(qwen_path, tmp_path, capsys, monkeypatch):
    """A constant reward and a length limit no completion of the random tiny model ends within: one
    line and one event per cause, at step 2, not again at step 3; the end-of-run warning names them."""
    from rlft.api import train

    monkeypatch.setenv("COLUMNS", "250")
    (tmp_path / "reward.py").write_text(CONSTANT)
    run = tmp_path / "run"
    cfg = {"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(qwen_path)},
           "data": {"train": str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}."} for i in range(6)]))},
           "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1, "precision": "fp32"},
           "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 2},
           "rewards": [{"fn": f"{tmp_path / 'reward.py'}:constant"}],
           "algorithm": {"kl_coef": 0.0},  # no KL term: nothing at all to update on
           "logging": {"progress": False}}
    summary = train(cfg)
    said = _said(capsys)
    assert summary["status"] == "completed" and summary["optimizer_steps"] == 0
    assert said.count("warn: zero_variance") == 1 and said.count("warn: truncation") == 1, said
    assert ("warn: zero_variance at step 2: every group's completions got equal rewards in each of the last 2 steps "
            "(adv/zero_std_group_frac 1) (reward/mean 0): no advantage, so the run learns nothing") in said
    assert ("warn: truncation at step 2: every completion hit the length limit in each of the last 2 steps "
            "(completion/truncation_rate 1)") in said
    assert [(e["step"], e["detector"]) for e in _events(run)] == [(2, "zero_variance"), (2, "truncation")]
    assert "The health monitor saw: truncation, zero_variance (warnings above)." in summary["warning"]
