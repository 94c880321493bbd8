"""verifiers environments (issue 42): `agent.environment: verifiers:ENV` trains with the
environment's own dataset, rollout loop and rubric through the policy's OpenAI-compatible endpoint.

The environments below are written against verifiers' classic API (vf.SingleTurnEnv, MultiTurnEnv,
ToolEnv, Rubric, XMLParser: verifiers 0.1 to 0.3; 0.4 replaced it). The arithmetic task is the
demo's: prompts "What is a + b?" with their answers; its rubric scores correctness, the share of
digits in the answer (what the tiny random model can learn in a few steps) and the parser's format.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")
vf = pytest.importorskip("verifiers")
if not hasattr(vf, "SingleTurnEnv"):
    pytest.skip("verifiers without its classic environments (0.4+)", allow_module_level=True)

from conftest import SpyEngine  # noqa: E402

from rlft.config import AgentConfig, LoraConfig, ModelConfig  # noqa: E402
from rlft.errors import ConfigError, DataError  # noqa: E402
from rlft.models.loading import load_policy  # noqa: E402
from rlft.rollout.agent.build import agent_driver  # noqa: E402
from rlft.rollout.agent.environments import EpisodeRow  # noqa: E402
from rlft.rollout.contract import SamplingParams  # noqa: E402
from rlft.rollout.engines import build_engine  # noqa: E402

ENVIRONMENTS = '''
import json, random

import verifiers as vf
from datasets import Dataset


def _sums(seed, n):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return Dataset.from_list(rows)


def _rubric(parser):
    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def digits(completion, **kwargs) -> float:
        """The share of digits in the last answer."""
        texts = [m["content"] or "" for m in completion if m["role"] == "assistant"] if completion else []
        text = texts[-1] if texts else ""
        return sum(c.isdigit() for c in text) / max(len(text), 1)

    return vf.Rubric(funcs=[correct_answer, digits, parser.get_format_reward_func()], weights=[1.0, 1.0, 0.2],
                     parser=parser)


def load_environment(num_train: int = 16, num_eval: int = 8):
    """The demo's arithmetic task, single-turn."""
    parser = vf.XMLParser(["answer"], answer_field="answer")
    return vf.SingleTurnEnv(dataset=_sums(0, num_train), eval_dataset=_sums(1, num_eval),
                            system_prompt="Answer with the number only.", parser=parser, rubric=_rubric(parser),
                            sampling_args={"temperature": 0.7, "max_tokens": 10})


class TwoTries(vf.MultiTurnEnv):
    """A second try after feedback."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Try again, digits only."}]


def multi_turn():
    parser = vf.XMLParser(["answer"], answer_field="answer")
    return TwoTries(dataset=_sums(0, 4), parser=parser, rubric=_rubric(parser), max_turns=2)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def tools():
    parser = vf.XMLParser(["answer"], answer_field="answer")
    return vf.ToolEnv(dataset=_sums(0, 4), tools=[add], parser=parser, rubric=_rubric(parser), max_turns=3)


def group_rubric():
    def best_of_group(completions, **kwargs) -> list:
        return [0.0] * len(completions)

    return vf.SingleTurnEnv(dataset=_sums(0, 4), rubric=vf.Rubric(funcs=[best_of_group]))


def broken():
    raise RuntimeError("the environment's own bug")


def eval_only():
    parser = vf.XMLParser(["answer"], answer_field="answer")
    return vf.SingleTurnEnv(eval_dataset=_sums(1, 4), parser=parser, rubric=_rubric(parser))


def lambdas():
    return vf.SingleTurnEnv(dataset=_sums(0, 4), rubric=vf.Rubric(funcs=[lambda completion, **kw: 1.0,
                                                                       lambda completion, **kw: 0.0]))
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """The environments' file, and a module per loader (verifiers:FILE calls its load_environment)."""
    folder = tmp_path_factory.mktemp("verifiers")
    (folder / "arith_envs.py").write_text(ENVIRONMENTS)
    for name in ("multi_turn", "tools", "group_rubric", "broken", "eval_only", "lambdas"):
        (folder / f"{name}_env.py").write_text(
            f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location('arith_envs_{name}', "
            f"{str(folder / 'arith_envs.py')!r})\nm = importlib.util.module_from_spec(spec)\n"
            f"spec.loader.exec_module(m)\nload_environment = m.{name}\n")
    return folder


@pytest.fixture(scope="module")
def policy(qwen_path):
    return load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())


def episodes(policy, env_ref, n=2, prompts=2, **agent):
    """One batch of episodes of `env_ref` on the tiny policy: the completions and what was sampled."""
    from rlft.data.readers import read_rows

    cfg = AgentConfig(environment=env_ref, max_total_tokens=96, **agent)
    rows = read_rows("verifiers:train", agent=cfg)[:prompts]
    spy = SpyEngine(build_engine(policy, 0, "hf"))
    driver = agent_driver(cfg, spy, policy.tokenizer, [], 4096, 0)
    try:
        out = driver.run([r.data["prompt"] for r in rows], SamplingParams(n=n, temperature=1.0, max_new_tokens=10),
                         rows=[EpisodeRow(r.where, {k: v for k, v in r.data.items() if k != "prompt"}, i)
                               for i, r in enumerate(rows)])
    finally:
        driver.close()
    torch.set_num_threads(1)
    return out, spy.samples


def test_a_single_turn_environment_runs_its_rollout_and_rubric(policy, envs):
    out, samples = episodes(policy, f"verifiers:{envs / 'arith_envs.py'}")
    assert len(out) == 4 and len(samples) == 4
    sampled = {(tuple(p), tuple(ids)) for p, ids in samples}
    for c in out:
        assert c.episode.program_ok and c.episode.turns == 1 and c.episode.prefix_breaks == 0
        assert (tuple(c.prompt_ids), tuple(c.completion_ids)) in sampled  # trained: exactly what was sampled
        scores = c.episode.program_reward
        assert set(scores) == {"correct_answer", "digits", "format_reward_func", "num_turns", "reward"}
        assert scores["reward"] == pytest.approx(scores["correct_answer"] + scores["digits"]
                                                 + 0.2 * scores["format_reward_func"])
    # the environment's own prompt (its system prompt) is what the model answered
    assert "Answer with the number only." in policy.tokenizer.decode(out[0].prompt_ids)


def test_the_environments_datasets_are_the_runs_prompts(envs, policy):
    from rlft.data.readers import read_rows

    agent = AgentConfig(environment=f"verifiers:{envs / 'arith_envs.py'}",
                        environment_args={"num_train": 5, "num_eval": 3})
    train, held_out = read_rows("verifiers:train", agent=agent), read_rows("verifiers:eval", agent=agent)
    assert len(train) == 5 and len(held_out) == 3
    row = train[0].data
    assert row["prompt"][0] == {"role": "system", "content": "Answer with the number only."}
    assert row["prompt"][1]["content"].startswith("What is ") and row["answer"].isdigit()
    assert train[0].where.endswith("[train]#0")
    with pytest.raises(DataError, match="verifiers:train .*or verifiers:eval"):
        read_rows("verifiers:test", agent=agent)
    with pytest.raises(DataError, match="names none; set agent.environment"):
        read_rows("verifiers:train")
    with pytest.raises(DataError, match="has no eval_dataset"):
        read_rows("verifiers:eval", agent=AgentConfig(environment=f"verifiers:{envs / 'multi_turn_env.py'}"))
    with pytest.raises(DataError, match="has no dataset; give data.train another source"):  # an eval-only one
        read_rows("verifiers:train", agent=AgentConfig(environment=f"verifiers:{envs / 'eval_only_env.py'}"))
    # an evaluation suite reads it too (with the run's agent section)
    from rlft.config import EvalSuite
    from rlft.eval.suites import prepare_suites

    suite = EvalSuite(name="held", data="verifiers:eval", rewards=[{"fn": "program", "args": {"key": "reward"}}])
    [prepared] = prepare_suites([suite], policy.tokenizer, 4096, agent=agent)
    assert len(prepared.examples) == 3


def test_rewards_left_out_are_the_rubrics_functions_with_its_weights(envs, tmp_path, qwen_path):
    from pydantic import ValidationError

    from rlft.config import Config
    from rlft.rollout.agent import reward_specs

    cfg = Config(method="grpo", output_dir=str(tmp_path / "run"), model={"path": str(qwen_path)},
                 data={"train": "verifiers:train"}, agent={"environment": f"verifiers:{envs / 'arith_envs.py'}"})
    assert cfg.rewards == []  # config.yaml says what was given; the run reads the rubric
    rewards = reward_specs(cfg.rewards, cfg.agent)
    assert [(r.component, r.weight, r.args) for r in rewards] == [
        ("correct_answer", 1.0, {"key": "correct_answer"}), ("digits", 1.0, {"key": "digits"}),
        ("format_reward_func", 0.2, {"key": "format_reward_func"}), ("num_turns", 0.0, {"key": "num_turns"})]
    assert {r.fn for r in rewards} == {"program"}
    # given rewards are kept
    cfg = Config(method="grpo", output_dir=str(tmp_path / "run"), model={"path": str(qwen_path)},
                 data={"train": "verifiers:train"}, agent={"environment": f"verifiers:{envs / 'arith_envs.py'}"},
                 rewards=[{"fn": "program", "args": {"key": "reward"}}])
    assert [r.args for r in reward_specs(cfg.rewards, cfg.agent)] == [{"key": "reward"}]
    # the environment's datasets without the environment, and no rewards without one: refused
    with pytest.raises(ValidationError, match="agent.environment names none"):
        Config(method="grpo", output_dir=str(tmp_path / "run"), model={"path": str(qwen_path)},
               data={"train": "verifiers:train"}, rewards=[{"fn": "math"}])
    with pytest.raises(ValidationError, match="needs at least one reward component"):
        Config(method="grpo", output_dir=str(tmp_path / "run"), model={"path": str(qwen_path)},
               data={"train": "train.jsonl"})


def test_what_cannot_run_is_refused_at_start_up(envs, policy):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="verifiers:my_env"):
        AgentConfig(environment="verifiers:my_env.py:load_environment")
    with pytest.raises(ValidationError, match="drop agent.tools"):
        AgentConfig(environment=f"verifiers:{envs / 'arith_envs.py'}", tools=["calculator"])
    with pytest.raises(ValidationError, match="drop agent.tools and agent.environment"):
        AgentConfig(environment=f"verifiers:{envs / 'arith_envs.py'}", program=f"{envs / 'arith_envs.py'}:add")

    def load(name, **args):
        cfg = AgentConfig(environment=f"verifiers:{name}", environment_args=args)
        agent_driver(cfg, build_engine(policy, 0, "hf"), policy.tokenizer, [], 4096, 0).close()

    with pytest.raises(ConfigError, match="group reward functions"):
        load(envs / "group_rubric_env.py")
    with pytest.raises(ConfigError, match=r"several functions named \['<lambda>'\]"):
        load(envs / "lambdas_env.py")
    with pytest.raises(ConfigError, match="load_environment raised:(.|\n)*the environment's own bug"):
        load(envs / "broken_env.py")
    with pytest.raises(ConfigError, match="cannot take agent.environment_args"):
        load(envs / "arith_envs.py", levels=3)
    with pytest.raises(ConfigError, match="no_such_env_module"):
        load("no-such-env-module")


def test_a_multi_turn_environment_continues_one_exact_sequence(policy, envs):
    """Its second prompt is the first prompt, the reply and the environment's message: one
    training sequence, the two samples trained, the message between them masked."""
    out, samples = episodes(policy, f"verifiers:{envs / 'multi_turn_env.py'}")
    assert len(out) == 4 and len(samples) == 8
    for c in out:
        assert c.episode.turns == 2 and c.episode.prefix_breaks == 0 and c.episode.program_ok
        assert c.episode.program_reward["num_turns"] == 2.0
        assert 0 in c.mask and c.mask[0] == 1 and c.mask[-1] == 1


def test_a_tool_environment_offers_its_tools_through_the_endpoint(policy, envs):
    """vf.ToolEnv sends its tools with every call; the tiny model rarely calls them, so this checks
    the episodes run and score (a call, when made, continues the sequence like any turn)."""
    out, _ = episodes(policy, f"verifiers:{envs / 'tools_env.py'}")
    assert len(out) == 4
    for c in out:
        assert c.episode.program_ok and 1 <= c.episode.turns <= 3 and c.episode.prefix_breaks == 0
        assert {"total_tool_calls", "add_calls", "reward"} <= set(c.episode.program_reward)


class ScriptedEngine(SpyEngine):
    """Answers as a model that calls the tool first, then answers: a tool call when the prompt
    holds no tool result yet (the tiny model's template shows one as a `tool` turn), else the sum
    (text encoded with the end of turn, log-probs 0)."""

    def __init__(self, engine, tokenizer):
        super().__init__(engine)
        self.tokenizer = tokenizer

    def generate(self, prompts, params, first_prompt=0, streams=None):
        import dataclasses

        out = []
        for c in self.engine.generate(prompts, params, first_prompt, streams):
            seen = self.tokenizer.decode(c.prompt_ids)
            text = "44" if "<|im_start|>tool" in seen else \
                '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 24}}\n</tool_call>'
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.convert_tokens_to_ids(
                "<|im_end|>")]
            out.append(dataclasses.replace(c, completion_ids=ids, text=text, logprobs=[0.0] * len(ids),
                                           finish_reason="stop"))
        self.samples += [(list(c.prompt_ids), list(c.completion_ids)) for c in out]
        return out


def test_a_tool_environments_calls_run_and_continue_one_exact_sequence(policy, envs):
    """A model that calls vf.ToolEnv's tool: the call comes back through the OpenAI tools API,
    the environment runs it and sends the result, and the episode is one sequence whose trained
    runs are the two samples (the tool result between them masked)."""
    from rlft.data.readers import read_rows

    cfg = AgentConfig(environment=f"verifiers:{envs / 'tools_env.py'}", max_total_tokens=200)
    rows = read_rows("verifiers:train", agent=cfg)[:1]
    spy = ScriptedEngine(build_engine(policy, 0, "hf"), policy.tokenizer)
    driver = agent_driver(cfg, spy, policy.tokenizer, [], 4096, 0)
    try:
        [c] = driver.run([rows[0].data["prompt"]], SamplingParams(n=1, temperature=1.0, max_new_tokens=40),
                         rows=[EpisodeRow(rows[0].where, {k: v for k, v in rows[0].data.items() if k != "prompt"})])
    finally:
        driver.close()
    torch.set_num_threads(1)
    assert c.episode.program_ok and c.episode.turns == 2 and c.episode.prefix_breaks == 0
    assert c.episode.program_reward["add_calls"] == 1.0 and c.episode.program_reward["total_tool_calls"] == 1.0
    runs, cur = [], []
    for token, m in zip(c.completion_ids, c.mask):
        if m:
            cur.append(token)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    assert [tuple(r) for r in runs] == [tuple(ids) for _, ids in spy.samples]
    inserted = policy.tokenizer.decode([t for t, m in zip(c.completion_ids, c.mask) if not m])
    assert "<|im_start|>tool\n44<|im_end|>" in inserted  # the tool's result, never trained on


def _run_config(tmp_path, qwen_path, envs, **over):
    cfg = {"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
           "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": "verifiers:train", "eval": "verifiers:eval"},
           "training": {"learning_rate": 1e-2, "max_steps": 8, "num_threads": 1, "lr_scheduler": "constant",
                        "precision": "fp32", "eval_every": 100},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12},
           "eval": {"temperature": 1.0, "num_samples": 2, "max_new_tokens": 12},
           "agent": {"environment": f"verifiers:{envs / 'arith_envs.py'}", "max_total_tokens": 64},
           "logging": {"progress": False}}
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    return cfg


def test_a_verifiers_run_learns_and_rlft_eval_runs_its_eval_split(tmp_path, qwen_path, envs, monkeypatch, capsys):
    """GRPO on the environment's dataset with its rubric as the rewards (none given): each rubric
    function is a logged component, the held-out reward (its eval_dataset) ends above the
    starting model's, and `rlft eval RUN --data verifiers:eval` evaluates the run on it."""
    from conftest import run_main

    from rlft.api import train
    from rlft.eval.run import evaluate_model

    summary = train(_run_config(tmp_path, qwen_path, envs))
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert summary["status"] == "completed" and len(rows) == 8
    for name in ("correct_answer", "digits", "format_reward_func", "num_turns"):
        assert f"reward/{name}" in rows[0], sorted(rows[0])
    first = sum(r["reward/digits"] for r in rows[:2]) / 2
    last = sum(r["reward/digits"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)

    from rlft.config import EvalConfig, load_config

    run_cfg = load_config(tmp_path / "run" / "config.yaml")
    assert run_cfg.rewards == []  # as given: the rubric's
    before = evaluate_model(qwen_path, "verifiers:eval", run_cfg.rewards,
                            EvalConfig(temperature=1.0, num_samples=2, max_new_tokens=12), agent=run_cfg.agent).metrics
    torch.set_num_threads(1)
    assert summary["eval/reward_mean"] > before["eval/reward_mean"] + 0.05, (before, summary)

    result = run_main(monkeypatch, capsys, "eval", str(tmp_path / "run"), "--data", "verifiers:eval",
                      "--max-examples", "4")
    torch.set_num_threads(1)
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads(next((tmp_path / "run" / "evals").glob("*.json")).read_text())
    assert saved["data"] == "verifiers:eval" and "eval/reward_mean" in saved["metrics"], sorted(saved["metrics"])
    assert "eval/accuracy" in saved["metrics"]  # the first rubric function (correct_answer) counts a sample correct


def test_async_verifiers_run_trains(tmp_path, qwen_path, envs):
    from rlft.api import train

    summary = train(_run_config(tmp_path, qwen_path, envs, data={"train": "verifiers:train", "eval": None},
                                training={"learning_rate": 1e-3, "max_steps": 2},
                                rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8,
                                         "async_steps": 1},
                                algorithm={"rollout_correction": "tis"}))
    torch.set_num_threads(1)
    assert summary["status"] == "completed" and summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/digits" in r for r in rows if "reward/mean" in r)


def test_the_shipped_example_environment_runs_episodes(policy, tmp_path):
    """examples/verifiers_env.py, as the agents guide configures it: its rubric is the rewards
    left out, and one batch of its episodes runs."""
    from pathlib import Path

    from rlft.config import Config
    from rlft.rollout.agent import reward_specs

    example = Path(__file__).resolve().parents[1] / "examples" / "verifiers_env.py"
    cfg = Config(method="grpo", output_dir=str(tmp_path / "run"), model={"path": "runs/sft/final"},
                 data={"train": "verifiers:train", "eval": "verifiers:eval"},
                 agent={"environment": f"verifiers:{example}", "environment_args": {"num_train": 8, "num_eval": 4}})
    assert [(r.component, r.weight) for r in reward_specs(cfg.rewards, cfg.agent)] == [("correct_answer", 1.0), ("format_reward_func", 0.2),
                                                               ("num_turns", 0.0)]
    out, _ = episodes(policy, f"verifiers:{example}", environment_args={"num_train": 8, "num_eval": 4})
    assert len(out) == 4 and all(c.episode.program_ok for c in out)
    assert all(set(c.episode.program_reward) == {"correct_answer", "format_reward_func", "num_turns", "reward"}
               for c in out)
