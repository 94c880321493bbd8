"""Environments (agent.environment): observations inserted token-exact and loss-masked, their
rewards through the `environment` reward component, episodes ending on done or on a limit (a call that
hangs: at its time limit, or at once on Ctrl-C), seeds
that replay, errors that name the environment and the row, and gem-llm games end to end.

Unit tests drive episodes with the scripted engine of conftest.py (a random tiny model never
writes a guess), and a toy higher/lower game whose secret the test can compute from the seed."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (ScriptedEngine, assert_clean_user_error, call_text, interrupt_when_hung, run_main,
                      write_jsonl)
from rlft.errors import ConfigError, EnvironmentFailed
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.contract import SamplingParams
from rlft.rollout.agent.environments import EpisodeRow, load_environment
from rlft.rollout.seeds import stream_seed
from rlft.rollout.agent.tool_calls import pick_parser
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver, episode_metrics

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Let's play."}]

GAME = '''
import os
import random
import re
import time


class HigherLower:
    """Guess a secret in [1, high], told whether it is even: 'higher' / 'lower' (reward 0) until the
    right guess (reward 1, done)."""

    def __init__(self, seed, high=16, trap=None):
        self.secret, self.high, self.trap = random.Random(seed).randint(1, high), high, trap

    def reset(self, **row):
        if row.get("boom") or (row.get("trap") and self.trap and os.path.exists(self.trap)):
            raise ValueError("boom in reset")
        if row.get("keep_prompt"):
            return None
        return f"Guess my number between 1 and {self.high}; it is {('even', 'odd')[self.secret % 2]}."

    def step(self, text):
        found = re.search(r"\\d+", text)
        if found is None:
            return "Say a number.", -0.1, False
        guess = int(found.group())
        if guess == 99:
            raise RuntimeError("the grader fell over")
        if guess == self.secret:
            return "Correct!", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


def helper(seed):
    return seed


class NoStep:
    def __init__(self, seed):
        pass

    def reset(self, **row):
        return None


class NoSeed:
    def __init__(self):
        pass

    def reset(self, **row):
        return None

    def step(self, text):
        return "", 0.0, True


class Unseeded(HigherLower):
    def reset(self, **row):
        return f"Guess my number (today: {random.random()})."


class BadStep(HigherLower):
    def step(self, text):
        return "ok", "1.0", False


class Hang(HigherLower):
    """The steps (with hang_reset: the resets) of every instance after the first `calm` ones hang:
    they touch $RLFT_TEST_MARKER, then wait until $RLFT_TEST_RELEASE exists, at most $RLFT_TEST_HANG_S
    seconds (default 600: so a test that fails does not hang for good)."""

    made = 0

    def __init__(self, seed, calm=0, hang_reset=False):
        super().__init__(seed)
        Hang.made += 1
        self.hangs, self.hang_reset = Hang.made > calm, hang_reset

    def _hang(self):
        if not self.hangs:
            return
        if os.environ.get("RLFT_TEST_MARKER"):
            open(os.environ["RLFT_TEST_MARKER"], "a").close()
        release = os.environ.get("RLFT_TEST_RELEASE", "")
        until = time.monotonic() + float(os.environ.get("RLFT_TEST_HANG_S", "600"))
        while time.monotonic() < until and not (release and os.path.exists(release)):
            time.sleep(0.05)

    def reset(self, **row):
        if self.hang_reset:
            self._hang()
        return super().reset(**row)

    def step(self, text):
        self._hang()
        return super().step(text)
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("envs") / "model", seed=0)
    return path, load_policy(ModelConfig(path=str(path), device="cpu"), LoraConfig())


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    path = tmp_path_factory.mktemp("game") / "game.py"
    path.write_text(GAME)
    return path


def secret(run_seed: int, draw: int, high: int = 16) -> int:
    return random.Random(stream_seed(run_seed, "environment", draw)).randint(1, high)


def env_driver(policy, game, script, cls="HigherLower", tools=(), run_seed=0, engine=None, **limits):
    engine = engine or ScriptedEngine(policy.tokenizer, script)
    source = load_environment(f"{game}:{cls}", {}, run_seed, max_prompt_tokens=512)
    driver = TurnDriver(engine, policy.tokenizer, load_tools(list(tools)), pick_parser("auto", None),
                        AgentLimits(**limits), environment=source)
    return driver, engine


def test_observations_are_inserted_once_loss_masked_and_their_rewards_reach_the_reward(tiny, game):
    """Turn 1 guesses wrong, turn 2 right: the row = first observation | turn 1 as sampled | 'higher'
    or 'lower' as a user message (encoded once, mask 0) | turn 2 as sampled; the environment's
    rewards [0, 1] are the `environment` component, and the episode ends on done (no turn 3)."""
    from rlft.config import RewardSpec
    from rlft.data.prompts import prompt_example
    from rlft.rewards.scoring import RewardScorer, score_completions

    _, policy = tiny
    answer = secret(0, draw=7)
    wrong = answer % 16 + 1
    driver, engine = env_driver(policy, game, [f"Is it {wrong}?", f"It is {answer}.", "never sampled"])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50), rows=[EpisodeRow("games.jsonl:8", {}, 7)])
    opening = f"Guess my number between 1 and 16; it is {('even', 'odd')[answer % 2]}."
    first = [PROMPT[0], {"role": "user", "content": opening}]  # the system prompt stays
    assert ep.prompt_ids == driver.encoder.prompt_ids(first) and engine.contexts[0] == [ep.prompt_ids]
    hint = "higher" if wrong < answer else "lower"
    turn1, turn2 = engine.sampled[0][0], engine.sampled[1][0]
    obs = driver.encoder.observation_ids(first, [{"role": "user", "content": hint}], turn1[-1])
    assert policy.tokenizer.decode(obs) == f"\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n"
    assert ep.completion_ids == turn1 + obs + turn2 and engine.contexts[1] == [ep.prompt_ids + turn1 + obs]
    assert ep.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    batch = RolloutBatch.from_completions([ep], [0], policy.tokenizer.pad_token_id, torch.device("cpu"))
    assert batch.sampling_logprobs[0, len(turn1):len(turn1) + len(obs)].eq(0).all()
    record = ep.episode
    assert len(engine.contexts) == 2 and record.turns == 2  # done after turn 2, though max_turns is 4
    assert (record.env_rewards, record.env_done, record.env_final) == ([0.0, 1.0], True, "Correct!")
    assert record.env_tokens == len(obs) and record.tool_tokens == 0 and record.retokenize_drift == 0
    assert record.messages == [*first, {"role": "assistant", "content": f"Is it {wrong}?"},
                               {"role": "user", "content": hint}, {"role": "assistant", "content": f"It is {answer}."}]

    seen = {}

    def spy(prompt, completion, **row):
        seen.update(row, prompt=prompt, completion=completion)
        return 0.0

    example = prompt_example(policy.tokenizer, "games.jsonl:8", PROMPT, {"level": 1})
    scorer = RewardScorer([RewardSpec(fn="environment"), RewardSpec(fn="environment", name="last",
                                                                    args={"reduce": "last"})])
    scorer.components.append(("spy", spy, 0.0))
    scores = score_completions(scorer, [example], [ep], 50)
    assert scores.components["environment"] == [1.0] and scores.components["last"] == [1.0]
    assert scores.total == [2.0] and scores.metrics()["reward/environment"] == 1.0
    assert seen["prompt"] == opening and seen["completion"] == f"It is {answer}."
    assert (seen["env_rewards"], seen["env_done"], seen["turns"], seen["tool_calls"], seen["level"]) == \
        ([0.0, 1.0], True, 2, 0, 1)
    assert seen["messages"] == record.messages
    metrics = episode_metrics([ep])
    assert metrics["env/return_mean"] == 1.0 and metrics["env/episodes_done"] == 1.0
    assert metrics["env/episodes_cut"] == 0.0 and metrics["env/steps_mean"] == 2.0


def test_a_group_shares_its_seed_and_a_run_replays_with_the_real_engine(tiny, game):
    """The G episodes of a prompt start from one seed (the same secret: the baseline compares
    answers to one game); other draws and other run seeds start elsewhere; two runs with the same
    seed give the same episodes, token for token."""
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    _, policy = tiny
    source = load_environment(f"{game}:HigherLower", {}, run_seed=0)
    group = source.start(PROMPT, EpisodeRow("r:1", {}, 3), 4)[1]
    assert len({e.env.secret for e in group}) == 1 and len({id(e.env) for e in group}) == 4
    secrets = [source.start(PROMPT, EpisodeRow("r", {}, d), 1)[1][0].env.secret for d in range(20)]
    assert secrets == [secret(0, d) for d in range(20)] and len(set(secrets)) > 5
    assert secrets != [secret(1, d) for d in range(20)]

    def run():
        engine = HFEngine(policy.model, policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer),
                          policy.device, seed=5)
        driver, _ = env_driver(policy, game, [], engine=engine, max_turns=3, max_total_tokens=60)
        rows = [EpisodeRow("r:1", {}, 10), EpisodeRow("r:2", {}, 11)]
        # a stop string ends most turns early: finished actions, so episodes of several steps
        return driver.run([PROMPT, PROMPT], SamplingParams(n=2, max_new_tokens=12, stop=("a",)), rows=rows)

    a, b = run(), run()
    assert [(e.completion_ids, e.loss_mask, e.episode.env_rewards, e.episode.messages) for e in a] == \
        [(e.completion_ids, e.loss_mask, e.episode.env_rewards, e.episode.messages) for e in b]
    assert sum(len(e.episode.env_rewards) >= 2 for e in a) >= 2


def test_tool_calls_go_to_tools_and_a_plain_turn_to_the_environment(tiny, game):
    _, policy = tiny
    answer = secret(0, draw=0)
    driver, engine = env_driver(policy, game, [call_text("calculator", {"expression": f"{answer} * 1"}),
                                               f"{answer}"], tools=("calculator",))
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=80))
    record = ep.episode
    assert record.tool_calls == 1 and record.env_rewards == [1.0] and record.env_done
    assert [m["role"] for m in record.messages[2:]] == ["assistant", "tool", "assistant"]
    assert record.tool_tokens > 0 and record.env_tokens == 0


def test_limits_cut_an_episode_its_last_action_still_scored(tiny, game):
    _, policy = tiny
    answer = secret(0, draw=0)
    wrong = answer % 16 + 1
    # max_turns: the last allowed turn's action is stepped; its observation is never shown
    driver, engine = env_driver(policy, game, [str(wrong), str(wrong)], max_turns=2)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))
    record = ep.episode
    assert record.env_rewards == [0.0, 0.0] and not record.env_done and record.max_turns_reached
    assert record.env_final in ("higher", "lower") and len(engine.contexts) == 2
    assert record.messages[-1]["role"] == "assistant"
    # a turn cut by max_new_tokens is no finished action: not stepped, the episode ends
    driver, engine = env_driver(policy, game, [f"I think it is {answer}"])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=3))
    assert ep.finish_reason == "length" and ep.episode.env_rewards == [] and not ep.episode.env_done
    # the token budget: no room for the observation and a reply
    driver, engine = env_driver(policy, game, [str(wrong), str(answer)], max_total_tokens=8)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))
    assert ep.episode.budget_truncated and ep.episode.env_rewards == [0.0] and ep.episode.env_final
    metrics = episode_metrics([ep])
    assert metrics["env/episodes_cut"] == 1.0 and metrics["env/episodes_done"] == 0.0


def test_reset_may_keep_the_rows_prompt_and_reads_the_row(tiny, game):
    _, policy = tiny
    driver, _ = env_driver(policy, game, ["1"], max_turns=1)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50),
                      rows=[EpisodeRow("r:1", {"keep_prompt": True}, 0)])
    assert ep.episode.messages[:2] == PROMPT and ep.prompt_ids == driver.encoder.prompt_ids(PROMPT)


def test_bad_environments_are_clear_errors_naming_the_class_or_the_row(tiny, game):
    _, policy = tiny
    with pytest.raises(ConfigError, match=r"class NoStep has no step method"):
        load_environment(f"{game}:NoStep", {}, 0)
    with pytest.raises(ConfigError, match=r"NoSeed cannot be made as NoSeed\(seed=\.\.\."):
        load_environment(f"{game}:NoSeed", {}, 0)
    with pytest.raises(ConfigError, match=r"args \['size'\]"):
        load_environment(f"{game}:HigherLower", {"size": 3}, 0)
    with pytest.raises(ConfigError, match="no function 'Nope'"):
        load_environment(f"{game}:Nope", {}, 0)
    with pytest.raises(ConfigError, match="is a function, not a class"):
        load_environment(f"{game}:helper", {}, 0)

    def run(script, cls="HigherLower", fields=None, **limits):
        driver, _ = env_driver(policy, game, script, cls=cls, **limits)
        return driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50),
                          rows=[EpisodeRow("games.jsonl:4", fields or {}, 0)])

    with pytest.raises(EnvironmentFailed) as info:
        run(["1"], fields={"boom": True})
    message = str(info.value)
    assert f"environment '{game}:HigherLower' on games.jsonl:4: reset raised" in message
    assert "ValueError: boom in reset" in message and f'File "{game}"' in message
    with pytest.raises(EnvironmentFailed, match=r"games.jsonl:4: step raised:\n.*RuntimeError: the grader fell over"):
        run(["99"])
    with pytest.raises(EnvironmentFailed, match=r"step's reward is str '1.0', not a finite number"):
        run(["1"], cls="BadStep")
    with pytest.raises(EnvironmentFailed, match="(?s)different first observations .* random.Random\\(seed\\)"):
        run(["1"], cls="Unseeded")
    driver, _ = env_driver(policy, game, ["1"])
    driver.environment.max_prompt_tokens = 5
    with pytest.raises(EnvironmentFailed, match=r"prompt \d+ tokens, longer than data.max_prompt_length \(5\)"):
        driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))


def test_config_names_an_environment_or_says_what_is_missing(tmp_path, game, monkeypatch):
    from rlft.config import load_config

    base = {"method": "grpo", "output_dir": str(tmp_path / "r"), "model": {"path": "x"}, "data": {"train": "x"},
            "rewards": [{"fn": "environment"}]}
    cfg = load_config({**base, "agent": {"environment": f"{game}:HigherLower", "environment_args": {"high": 8}}})
    assert cfg.agent.tools == [] and cfg.agent.environment_args == {"high": 8}
    with pytest.raises(ConfigError, match="give tools .* or an environment"):
        load_config({**base, "agent": {}})
    with pytest.raises(ConfigError, match="agent.environment is not set"):
        load_config({**base, "agent": {"tools": ["calculator"]}})
    with pytest.raises(ConfigError, match="'module:Class', 'path/file.py:Class' or 'gem:<env id>'"):
        load_config({**base, "agent": {"environment": "HigherLower"}})
    with pytest.raises(ConfigError, match="Did you mean 'game:GuessTheNumber-v0-easy'"):
        load_environment("gem:game:GuessTheNumbr-v0-easy", {}, 0)
    monkeypatch.setitem(sys.modules, "gem", None)  # as if gem-llm were not installed
    with pytest.raises(ConfigError, match=r"pip install 'rlft\[gem\]'"):
        load_environment("gem:game:GuessTheNumber-v0-easy", {}, 0)


def test_a_gem_game_plays_several_turns_and_leaves_the_global_generators_alone(tiny):
    """GuessTheNumber through the driver: a wrong guess gets GEM's hint plus its suffix as a user
    message, the right one GEM's success reward and the end; Python's and numpy's global
    generators (which GEM's games draw from) are where they were."""
    import numpy as np

    _, policy = tiny
    row = EpisodeRow("games.jsonl:1", {}, 3)
    source = load_environment("gem:game:GuessTheNumber-v0-easy", {}, run_seed=0)
    answer = source.start(PROMPT, row, 1)[1][0].env.env.game_number  # the same seed: the same game
    wrong = answer % 10 + 1
    engine = ScriptedEngine(policy.tokenizer, [f"\\boxed{{{wrong}}}", f"\\boxed{{{answer}}}"])
    driver = TurnDriver(engine, policy.tokenizer, [], pick_parser("auto", None), AgentLimits(max_total_tokens=200),
                        environment=source)
    random.seed(1), np.random.seed(1)
    expected = (random.random(), np.random.random())
    random.seed(1), np.random.seed(1)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=20), rows=[row])
    assert (random.random(), np.random.random()) == expected
    record = ep.episode
    assert record.messages[1]["content"].startswith("You are playing Guess The Number.")
    hint = "higher" if wrong < answer else "lower"
    assert record.messages[3] == {"role": "user", "content": f"At turn 1, you guessed {wrong}, and the target number "
                                                             f"is {hint} than {wrong}.\nEnter your next guess."}
    assert record.env_rewards == [0.0, 1.0] and record.env_done and record.env_final.startswith("Congratulations!")
    assert ep.loss_mask.count(0) == record.env_tokens > 0


def _grpo(path, data, out, environment, **over):
    config = {"method": "grpo", "output_dir": str(out), "seed": 0,
              "model": {"path": str(path)}, "data": {"train": str(data), "shuffle": False},
              "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "precision": "fp32"},
              # the stop string ends some turns before max_new_tokens: finished actions the game steps on
              "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8, "stop": ["a"]},
              "rewards": [{"fn": "environment"}],
              "agent": {"environment": environment, "max_turns": 2, "max_total_tokens": 48},
              "logging": {"progress": False, "sample_every": 1, "num_samples": 4}}
    for k, v in over.items():
        config[k] = {**config.get(k, {}), **v}
    return config


def _check_game_run(out, opening: str):
    """Every step logs the environment's metrics and its reward component, and each sample's
    component is the sum of the rewards its environment gave."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/return_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes_done"] + r["env/episodes_cut"] == 4 and "reward/environment" in r
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for s in samples:
        assert s["prompt"].startswith(opening) and s["transcript"][0]["role"] == "assistant"
        assert s["components"]["environment"] == pytest.approx(sum(s["env_rewards"]), abs=1e-12)
    assert any(s["env_rewards"] for s in samples)  # the games stepped (a random model's guess: a format error)
    for step in (1, 2):
        values = [s["components"]["environment"] for s in samples if s["step"] == step]
        assert steps[step - 1]["reward/environment"] == pytest.approx(sum(values) / 4, abs=1e-9)


def test_guess_the_number_from_gem_trains_end_to_end(tiny, tmp_path):
    from rlft.api import train

    path, _ = tiny
    data = write_jsonl(tmp_path / "games.jsonl", [{"prompt": "Play."}] * 4)
    summary = train(_grpo(path, data, tmp_path / "run", "gem:game:GuessTheNumber-v0-easy"))
    assert summary["status"] == "completed"
    _check_game_run(tmp_path / "run", "You are playing Guess The Number.")


def test_mastermind_from_gem_trains_end_to_end_through_the_cli(tiny, tmp_path, monkeypatch, capsys):
    import yaml

    path, _ = tiny
    data = write_jsonl(tmp_path / "games.jsonl", [{"prompt": "Play."}] * 4)
    config = tmp_path / "mastermind.yaml"
    config.write_text(yaml.safe_dump(_grpo(path, data, tmp_path / "run", "gem:game:Mastermind-v0-easy")))
    result = run_main(monkeypatch, capsys, "train", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_game_run(tmp_path / "run", "You are playing Mastermind.")


def test_a_run_stopped_by_its_environment_resumes_as_if_never_stopped(tiny, tmp_path, game, monkeypatch, capsys):
    """Step 2's rows spring a trap (while a flag file exists): the run stops with one error naming
    the environment and the row, step 1 saved; without the flag, the resumed run's metrics are
    those of a run never stopped: its episodes are functions of their seeds."""
    import yaml

    path, _ = tiny
    rows = [{"prompt": "Play."}] * 2 + [{"prompt": "Play.", "trap": True}] * 2 + [{"prompt": "Play."}] * 2
    data = write_jsonl(tmp_path / "games.jsonl", rows)
    flag = tmp_path / "flag"
    flag.touch()

    def config(name):
        cfg = _grpo(path, data, tmp_path / name, f"{game}:HigherLower", training={"max_steps": 3})
        cfg["agent"]["environment_args"] = {"trap": str(flag)}
        return cfg

    (tmp_path / "game.yaml").write_text(yaml.safe_dump(config("stopped")))
    result = run_main(monkeypatch, capsys, "train", str(tmp_path / "game.yaml"))
    err = assert_clean_user_error(result)
    assert f"environment '{game}:HigherLower' on {data}:3: reset raised" in err and "boom in reset" in err
    assert "The last completed step (1) is saved" in err
    flag.unlink()  # the fix
    from rlft.api import train

    assert train(config("stopped"))["status"] == "completed"
    assert train(config("straight"))["status"] == "completed"

    def metrics(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time", "tokens_per_s"))}
                for line in lines]

    straight = metrics("straight")
    assert [r["step"] for r in straight if "env/return_mean" in r] == [1, 2, 3]
    assert metrics("stopped") == straight


# -- a call that never returns (round 4 of the misuse issue) ---------------------------------------

def test_an_environment_call_that_never_returns_is_cut_at_its_time_limit(tiny, game, tmp_path, monkeypatch):
    """Before: environment calls had no time limit, so a step that never returned held the run
    forever. Now a late step ends its episode there (as a late tool call under on_tool_error=end:
    finish 'stop', nothing inserted, its action unrewarded) and is counted; a late reset stops the
    run naming the limit; a stop request (Ctrl-C) ends the wait at once, whatever the limit."""
    from rlft.rewards.calls import ScoringInterrupted

    _, policy = tiny
    monkeypatch.setenv("RLFT_TEST_RELEASE", str(tmp_path / "release"))
    monkeypatch.setenv("RLFT_TEST_HANG_S", "5")  # without a limit: 5 s a call, not forever
    try:
        driver, engine = env_driver(policy, game, ["Is it 3?", "never sampled"], cls="Hang", env_step_timeout_s=0.5)
        start = time.perf_counter()
        episodes = driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50))
        took = time.perf_counter() - start
        assert 1.0 <= took < 4.0, took  # the two steps one after the other, each abandoned at 0.5 s
        assert len(engine.contexts) == 1  # no episode took a second turn
        for ep in episodes:
            record = ep.episode
            assert record.env_timed_out and record.env_rewards == [] and not record.env_done
            assert ep.finish_reason == "stop" and record.turns == 1 and ep.loss_mask == [1] * len(ep.completion_ids)
            assert record.messages[-1] == {"role": "assistant", "content": "Is it 3?"}
        metrics = episode_metrics(episodes)
        assert metrics["env/step_timeouts"] == 2.0 and metrics["env/episodes_cut"] == 2.0

        hangs_in_reset = load_environment(f"{game}:Hang", {"hang_reset": True}, 0)
        driver = TurnDriver(ScriptedEngine(policy.tokenizer, ["1"]), policy.tokenizer, [], pick_parser("auto", None),
                            AgentLimits(env_step_timeout_s=0.5), environment=hangs_in_reset)
        with pytest.raises(EnvironmentFailed, match=r"on prompt 0: reset did not return within 0.5 s "
                                                    r"\(agent.env_step_timeout_s\)\nFix: .*raise agent.env_step_t"):
            driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))

        asked = time.perf_counter() + 0.3  # a Ctrl-C 0.3 s into a step under the default limit (a minute)
        hangs = load_environment(f"{game}:Hang", {}, 0)
        driver = TurnDriver(ScriptedEngine(policy.tokenizer, ["Is it 3?"]), policy.tokenizer, [],
                            pick_parser("auto", None), AgentLimits(), environment=hangs,
                            should_stop=lambda: time.perf_counter() > asked)
        start = time.perf_counter()
        with pytest.raises(ScoringInterrupted):
            driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))
        assert time.perf_counter() - start < 2.0
    finally:
        (tmp_path / "release").touch()  # the abandoned calls return


def test_a_run_whose_environment_hangs_completes_with_those_episodes_cut(tiny, tmp_path, game, monkeypatch):
    from rlft.api import train
    from rlft.config import load_config

    path, _ = tiny
    monkeypatch.setenv("RLFT_TEST_RELEASE", str(tmp_path / "release"))
    monkeypatch.setenv("RLFT_TEST_HANG_S", "5")  # without a limit: 5 s a call, not forever
    data = write_jsonl(tmp_path / "games.jsonl", [{"prompt": "Play."}] * 4)
    cfg = _grpo(path, data, tmp_path / "run", f"{game}:Hang", agent={"env_step_timeout_s": 0.5})
    assert load_config(cfg).agent.env_step_timeout_s == 0.5
    assert load_config({**cfg, "agent": {"environment": f"{game}:Hang"}}).agent.env_step_timeout_s == 60.0  # on
    try:
        start = time.perf_counter()
        summary = train(cfg)
        took = time.perf_counter() - start
    finally:
        (tmp_path / "release").touch()
    assert summary["status"] == "completed" and summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # every step the game took hung: each ended its episode, none was done
    assert sum(r["env/step_timeouts"] for r in rows) >= 1 and all(r["env/episodes_done"] == 0 for r in rows)
    assert all(r["env/steps_mean"] == 0 for r in rows)  # a late step earns no reward
    assert took < 60, took


RLFT = str(Path(sys.executable).parent / "rlft")  # the venv's `rlft` command, as tests/test_resume.py runs it


def test_one_ctrl_c_during_a_hung_environment_step_stops_within_seconds_with_a_checkpoint(tiny, tmp_path, game):
    """Before: the first Ctrl-C said 'stopping after this step ... saving a checkpoint' and the step
    never ended; only a second Ctrl-C exited, without saving. The limit here is long (600 s): the
    Ctrl-C ends the wait, not the limit."""
    from rlft.training import checkpoint as ckpt

    path, _ = tiny
    data = write_jsonl(tmp_path / "games.jsonl", [{"prompt": "Play."}] * 8)
    run = tmp_path / "run"
    cfg = _grpo(path, data, run, f"{game}:Hang", training={"max_steps": 3}, agent={"env_step_timeout_s": 600})
    cfg["agent"]["environment_args"] = {"calm": 4}  # step 1's four episodes play; step 2's hang at their first step
    cfg_path = tmp_path / "hang.yaml"
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    marker = tmp_path / "hanging"
    env = {**os.environ, "RLFT_TEST_MARKER": str(marker), "RLFT_TEST_RELEASE": str(tmp_path / "release"),
           "COLUMNS": "200"}
    try:
        output, took, returncode = interrupt_when_hung([RLFT, "train", str(cfg_path)], marker, env,
                                                       "environment")
    finally:
        (tmp_path / "release").touch()
    assert took < 10, (took, output)  # a checkpoint of the tiny model is written in this time
    assert returncode == 130 and "Traceback" not in output, output
    assert "second SIGINT" not in output and f"resume with: rlft train --resume {run}" in output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 1
    assert ckpt.find_latest(run / "checkpoints").name == "step-00000001"
