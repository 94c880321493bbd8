"""The user's reward code inside a training run: a hung reward never hangs the run (one Ctrl-C
stops it within seconds with a checkpoint), timeouts are counted and warned about, and a failing
reward stops the run with one message and the last completed step saved."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import interrupt_when_hung
from rlft.api import train
from rlft.errors import TrainingHalted
from rlft.models.tiny import build_tiny_model
from rlft.training import checkpoint as ckpt

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Each reward counts its calls in this process: a step is 2 calls (1 prompt x group of 2).
REWARDS = '''
import os, time
CALLS = {"n": 0}

def hang_in_step_2(prompt, completion, **row):
    CALLS["n"] += 1
    if CALLS["n"] > 2:
        open(os.environ["RLFT_TEST_MARKER"], "w").close()
        time.sleep(3600)
    return float(len(completion) % 3)

def raise_in_step_2(prompt, completion, **row):
    CALLS["n"] += 1
    if CALLS["n"] > 2:
        return {"a": 1.0}["missing"]
    return float(len(completion) % 3)

def hang_on_odd_calls(prompt, completion, **row):
    CALLS["n"] += 1
    if CALLS["n"] % 2:
        time.sleep(3600)
    return 1.0

def hang_from_step_2(prompt, completion, **row):
    CALLS["n"] += 1
    if CALLS["n"] > 2:
        time.sleep(3600)
    return float(len(completion) % 3)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_runtime")
    build_tiny_model(root / "model", seed=0)
    (root / "rewards.py").write_text(REWARDS)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    return root


def _config(root: Path, name: str, reward: str, **sections) -> dict:
    cfg = {
        "method": "grpo", "output_dir": str(root / "runs" / name), "seed": 0,
        "model": {"path": str(root / "model")}, "data": {"train": str(root / "prompts.jsonl")},
        "training": {"learning_rate": 1e-3, "max_steps": 4, "num_threads": 1},
        "rollout": {"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 4},
        "rewards": [{"fn": f"{root / 'rewards.py'}:{reward}"}],
        "scoring": {"max_workers": 2},
        "logging": {"progress": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _fresh_rewards_module():
    """The user's module is imported once per process; its call counter starts again per test."""
    for name in [n for n, m in sys.modules.items() if n.startswith("rlft_user_")]:
        del sys.modules[name]


def test_one_ctrl_c_stops_a_hung_reward_within_seconds_with_a_checkpoint(setup):
    run = setup / "runs" / "sigint"
    marker = setup / "hung"
    cfg_path = setup / "sigint.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(setup, "sigint", "hang_in_step_2", scoring={"timeout_s": 600})))
    env = {**os.environ, "PYTHONPATH": SRC, "RLFT_TEST_MARKER": str(marker), "COLUMNS": "200"}
    command = [sys.executable, "-m", "rlft.cli.app", "train", str(cfg_path)]
    output, took, returncode = interrupt_when_hung(command, marker, env, "reward")
    assert took < 10, (took, output)  # a checkpoint of the tiny model is written in this time
    assert returncode == 130, output
    assert "Traceback" not in output
    assert f"resume with: rlft train --resume {run}" in output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 1
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None and latest.name == "step-00000001"
    # the abandoned step's prompt draw is undone: the checkpoint holds the data order after step 1
    assert ckpt.load_trainer_state(latest)["parts"]["sampler"] == {"epoch": 0, "index": 1}


def test_a_reward_failing_mid_run_stops_with_one_message_and_the_last_step_saved(setup):
    _fresh_rewards_module()
    run = setup / "runs" / "raises"
    with pytest.raises(TrainingHalted) as info:
        train(_config(setup, "raises", "raise_in_step_2"))
    message = str(info.value)
    assert "reward 'raise_in_step_2'" in message and f"{setup / 'prompts.jsonl'}:" in message
    assert "KeyError: 'missing'" in message and 'return {"a": 1.0}["missing"]' in message
    assert "threading" not in message and "concurrent" not in message
    assert f"rlft train --resume {run}" in message and "step-00000001" in message
    assert ckpt.find_latest(run / "checkpoints").name == "step-00000001"


def test_timeouts_are_counted_per_step_and_warned_about(setup, capsys, monkeypatch):
    _fresh_rewards_module()
    monkeypatch.setenv("COLUMNS", "250")  # one console line per warning, unwrapped
    cfg = _config(setup, "timeouts", "hang_on_odd_calls", training={"max_steps": 2},
                  scoring={"timeout_s": 0.5, "max_infra_error_rate": 1.0})
    summary = train(cfg)
    assert summary["status"] == "completed"
    rows = [json.loads(x) for x in (setup / "runs" / "timeouts" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/timeouts"] for r in rows] == [1.0, 1.0] and all(r["reward/errors"] == 0 for r in rows)
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "timed out" in ln]
    assert len(warnings) == 2 and all("'hang_on_odd_calls'" in w and "1 of 2 calls" in w for w in warnings)


def test_a_reward_hanging_on_everything_stops_the_run_with_a_checkpoint(setup):
    _fresh_rewards_module()
    run = setup / "runs" / "hangs"
    cfg = _config(setup, "hangs", "hang_from_step_2", scoring={"timeout_s": 0.3, "max_consecutive_timeouts": 2})
    start = time.monotonic()
    with pytest.raises(TrainingHalted) as info:
        train(cfg)
    assert "timed out on 2 calls in a row" in str(info.value) and "step-00000001" in str(info.value)
    assert ckpt.find_latest(run / "checkpoints").name == "step-00000001"
    assert time.monotonic() - start < 60
