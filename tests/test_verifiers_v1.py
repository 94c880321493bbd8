"""verifiers 0.4 tasksets (issue 42): `agent.environment: verifiers:TASKSET` with verifiers' v1
stack trains on the taskset's tasks, scored by the task's own rewards, through the policy's endpoint.

verifiers 0.3 (the classic environments, tests/test_verifiers.py) and 0.4 are one distribution and
cannot be installed side by side, so `make test` installs 0.4 apart (`.venv/verifiers-v1`,
Makefile VERIFIERS_V1) and these tests run rlft in subprocesses with it first on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

V1_PATH = Path(os.environ.get("RLFT_VERIFIERS_V1_PATH", Path(sys.prefix) / "verifiers-v1"))
if not (V1_PATH / "verifiers" / "v1").is_dir():
    pytest.skip(f"verifiers 0.4 is not installed at {V1_PATH} (make install puts it there)", allow_module_level=True)
pytest.importorskip("fastapi")
pytest.importorskip("openai")

TASKSET = '''
import random
import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        """The share of digits in the reply (what the tiny random model can learn in a few steps)."""
        text = trace.last_reply or ""
        return sum(c.isdigit() for c in text) / max(len(text), 1)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 16
    split: str = "train"


class Sums(vf.Taskset[SumTask, SumsConfig]):
    """The demo's arithmetic task as a v1 taskset: its config's `split` picks the held-out sums."""

    def load(self):
        rng = random.Random(0 if self.config.split == "train" else 1)
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with the number only.",
                                  answer=str(a + b)), self.config.task)


__all__ = ["Sums"]
'''

TOOLS = '''
import verifiers.v1 as vf


class Echo(vf.Toolset):
    pass


class ToolTask(vf.Task):
    @classmethod
    def toolsets(cls, config):
        return [Echo(vf.ToolsetConfig())]


class ToolTasks(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        yield ToolTask(vf.TaskData(prompt="hi"), self.config.task)


__all__ = ["ToolTasks"]
'''

EPISODES = '''
import json, sys
from conftest import SpyEngine
from rlft.config import AgentConfig, LoraConfig, ModelConfig
from rlft.data.readers import read_rows
from rlft.models.loading import load_policy
from rlft.rollout.agent import agent_driver, reward_specs
from rlft.rollout.agent.environments import EpisodeRow
from rlft.rollout.contract import SamplingParams
from rlft.rollout.engines import build_engine

model, taskset, args, eval_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
policy = load_policy(ModelConfig(path=model, device="cpu"), LoraConfig())
cfg = AgentConfig(environment=f"verifiers:{taskset}", environment_args=args, environment_eval_args=eval_args,
                  max_total_tokens=96)
train, held_out = read_rows("verifiers:train", agent=cfg), read_rows("verifiers:eval", agent=cfg)
spy = SpyEngine(build_engine(policy, 0, "hf"))
driver = agent_driver(cfg, spy, policy.tokenizer, [], 4096, 0)
rows = train[:2]
out = driver.run([r.data["prompt"] for r in rows], SamplingParams(n=2, temperature=1.0, max_new_tokens=10),
                 rows=[EpisodeRow(r.where, {k: v for k, v in r.data.items() if k != "prompt"}, i)
                       for i, r in enumerate(rows)])
driver.close()
print(json.dumps({
    "specs": [s.model_dump(mode="json") for s in reward_specs([], cfg)],
    "train": [r.data for r in train], "held_out": [r.data for r in held_out],
    "episodes": [{"ok": c.episode.program_ok, "errors": c.episode.errors, "reward": c.episode.program_reward,
                  "turns": c.episode.turns, "breaks": c.episode.prefix_breaks, "prompt_ids": c.prompt_ids,
                  "completion_ids": c.completion_ids, "mask": c.loss_mask} for c in out],
    "sampled": spy.samples,
    "prompt_text": policy.tokenizer.decode(out[0].prompt_ids)}))
'''


def run_v1(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python ARGS` with verifiers 0.4 first on the path (and the tests' helpers importable)."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(V1_PATH), str(tests), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("verifiers_v1")
    (folder / "sums_tasks.py").write_text(TASKSET)
    (folder / "tool_tasks.py").write_text(TOOLS)
    return folder


def episodes(tmp_path: Path, model: Path, taskset: Path, args: dict, eval_args: dict) -> dict:
    """One batch of 2 x 2 episodes of the taskset on the model, its rows and what was sampled."""
    script = tmp_path / "episodes.py"
    script.write_text(EPISODES)
    result = run_v1(str(script), str(model), str(taskset), json.dumps(args), json.dumps(eval_args))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_tasksets_episodes_are_scored_by_its_rewards_and_trained_exactly(qwen_path, tasksets, tmp_path):
    got = episodes(tmp_path, qwen_path, tasksets / "sums_tasks.py", {"num_tasks": 5},
                   {"split": "test", "num_tasks": 3})
    # rewards left out: the trace's weighted total, each reward and metric logged beside it
    assert got["specs"] == [{"fn": "program", "name": "rubric", "weight": 1.0,
                             "args": {"key": "reward", "log_others": True}}]
    # the taskset's tasks are the rows (its config picks the held-out ones), the prompt as its messages
    assert len(got["train"]) == 5 and len(got["held_out"]) == 3
    row = got["train"][0]
    assert row["prompt"][0] == {"role": "system", "content": "Answer with the number only."}
    assert row["prompt"][1]["content"].startswith("What is ") and row["vf_task"]["answer"].isdigit()
    assert got["held_out"][0]["prompt"][1] != row["prompt"][1]
    sampled = {(tuple(p), tuple(ids)) for p, ids in got["sampled"]}
    assert len(got["episodes"]) == 4 and len(sampled) == 4
    for episode in got["episodes"]:
        assert episode["ok"] and episode["errors"] == {} and episode["turns"] == 1 and episode["breaks"] == 0
        assert (tuple(episode["prompt_ids"]), tuple(episode["completion_ids"])) in sampled  # exactly what was sampled
        scores = episode["reward"]
        assert set(scores) == {"correct", "digits", "reply_chars", "reward"}
        assert scores["reward"] == pytest.approx(scores["correct"] + scores["digits"])
    assert "Answer with the number only." in got["prompt_text"]  # the task's system prompt was answered


def test_a_taskset_run_learns_and_rlft_eval_runs_its_held_out_tasks(qwen_path, tasksets, tmp_path):
    """GRPO on the taskset with its rewards (none given): the digits reward rises, the held-out
    reward ends above the starting model's, and `rlft eval RUN --data verifiers:eval` runs."""
    run = tmp_path / "run"
    cfg = {"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": "verifiers:train", "eval": "verifiers:eval"},
           "training": {"learning_rate": 1e-2, "max_steps": 8, "num_threads": 1, "lr_scheduler": "constant",
                        "precision": "fp32", "eval_every": 100},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12},
           "eval": {"temperature": 1.0, "num_samples": 2, "max_new_tokens": 12},
           "agent": {"environment": f"verifiers:{tasksets / 'sums_tasks.py'}",
                     "environment_eval_args": {"split": "test", "num_tasks": 8}, "max_total_tokens": 64},
           "logging": {"progress": False}}
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    trained = run_v1("-m", "rlft", "train", str(tmp_path / "config.yaml"))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert summary["status"] == "completed" and len(rows) == 8
    for name in ("reward/rubric", "reward/rubric/correct", "reward/rubric/digits", "reward/rubric/reply_chars"):
        assert name in rows[0], sorted(rows[0])
    first = sum(r["reward/rubric/digits"] for r in rows[:2]) / 2
    last = sum(r["reward/rubric/digits"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)

    before = run_v1("-m", "rlft", "eval", str(qwen_path), "--config", str(tmp_path / "config.yaml"),
                    "--data", "verifiers:eval", "--out", str(tmp_path / "before.jsonl"))
    assert before.returncode == 0, before.stdout[-3000:] + before.stderr[-3000:]
    after = run_v1("-m", "rlft", "eval", str(run), "--data", "verifiers:eval")
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
    saved = json.loads(next((run / "evals").glob("*.json")).read_text())["metrics"]
    base = [json.loads(line)["reward"] for line in (tmp_path / "before.jsonl").read_text().splitlines()]
    assert saved["eval/reward_mean"] > sum(base) / len(base) + 0.05, (saved, base)
    assert saved["eval/reward_mean"] == pytest.approx(summary["eval/reward_mean"], abs=1e-6)


def test_what_a_taskset_cannot_run_is_refused_at_start_up(qwen_path, tasksets, tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(textwrap.dedent(f'''
        from rlft.config import AgentConfig
        from rlft.data.readers import read_rows
        from rlft.errors import RlftError

        for args in ({{"environment": "verifiers:{tasksets / 'tool_tasks.py'}"}},
                     {{"environment": "verifiers:{tasksets / 'sums_tasks.py'}", "environment_args": {{"levels": 3}}}},
                     {{"environment": "verifiers:{tasksets / 'sums_tasks.py'}"}},
                     {{"environment": "verifiers:no_such_taskset_module"}}):
            source = "verifiers:eval" if args == {{"environment": "verifiers:{tasksets / 'sums_tasks.py'}"}} \\
                else "verifiers:train"
            try:
                read_rows(source, agent=AgentConfig(**args))
                print("accepted", args)
            except RlftError as exc:
                print("refused:", str(exc).replace("\\n", " "))
    '''))
    result = run_v1(str(script))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("refused", "accepted"))]
    assert len(lines) == 4 and all(line.startswith("refused: ") for line in lines), lines
    tools, args, no_eval, missing = lines
    assert "tool servers (toolsets)" in tools
    assert "do not fit its taskset config" in args and "levels" in args
    assert "no eval split; set agent.environment_eval_args" in no_eval
    assert "no_such_taskset_module" in missing


def test_the_shipped_example_taskset_runs_episodes(qwen_path, tmp_path):
    """examples/verifiers_taskset.py, as the agents guide configures it."""
    example = Path(__file__).resolve().parents[1] / "examples" / "verifiers_taskset.py"
    got = episodes(tmp_path, qwen_path, example, {"num_tasks": 8}, {"split": "heldout", "num_tasks": 4})
    assert len(got["train"]) == 8 and len(got["held_out"]) == 4
    assert all(e["ok"] and set(e["reward"]) == {"correct", "answer_format", "reply_chars", "reward"}
               for e in got["episodes"])


def test_an_async_taskset_run_trains(qwen_path, tasksets, tmp_path):
    """async_steps 1: the episodes of the next batch (v1's interception server held per batch) run on
    the sampler's thread while the trainer steps."""
    run = tmp_path / "run"
    cfg = {"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": "verifiers:train"},
           "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "async_steps": 1},
           "algorithm": {"rollout_correction": "tis"},
           "agent": {"environment": f"verifiers:{tasksets / 'sums_tasks.py'}", "max_total_tokens": 64},
           "logging": {"progress": False}}
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    trained = run_v1("-m", "rlft", "train", str(tmp_path / "config.yaml"))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["step"] == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/rubric/digits" in r and r["agent/program_error_rate"] == 0.0
               for r in rows if "reward/mean" in r)
