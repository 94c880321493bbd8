"""OpenEnv environments (agent.environment: openenv:URL, openenv:module:Class, openenv:module:app):
a tiny OpenEnv game written here, served in this process (or by uvicorn in a process of its own
for the URL form), played through the turn driver with the scripted engine of conftest.py, then
trained on with GRPO; a step past agent.env_step_timeout_s ends its episode as with built-in
environments; errors (a server that is not there, a step that raises, a server that is full, an
action rlft cannot fill) are one clear message naming the environment.

openenv-core is the `openenv` extra. It is not in `dev`: it requires gradio, whose pins downgrade
packages the rest of the suite uses, so these tests skip where it is not installed (all but the
install hint's)."""

from __future__ import annotations

import gc
import json
import random
import socket
import subprocess
import sys
import time

import pytest

from conftest import ScriptedEngine, write_jsonl
from rlft.errors import ConfigError, EnvironmentFailed
from rlft.rollout.agent.environments import EpisodeRow, load_environment
from rlft.rollout.agent.tool_calls import pick_parser
from rlft.rollout.agent.turns import AgentLimits, TurnDriver, episode_metrics
from rlft.rollout.contract import SamplingParams
from rlft.rollout.seeds import stream_seed

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Let's play."}]

GAME = '''
import os
import random
import time

from pydantic import Field

from openenv.core import Action, Environment, Observation, State, create_fastapi_app


class GuessAction(Action):
    message: str = Field(..., description="the player's turn")


class GuessObservation(Observation):
    prompt: str = ""


class Guess(Environment):
    """Guess a secret in [1, high] drawn from reset's seed: 'higher' / 'lower' (reward 0) until the
    right guess (reward 1, done). A guess of 99 makes step raise."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.secret, self.high = 1, 16

    def reset(self, seed=None, episode_id=None, high=16):
        self.high, self.secret = high, random.Random(seed).randint(1, high)
        self._state = State(step_count=0)
        return GuessObservation(prompt=f"Guess my number between 1 and {high}.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        digits = "".join(c for c in action.message if c.isdigit())
        if digits == "99":
            raise RuntimeError("the grader fell over")
        if digits and int(digits) == self.secret:
            return GuessObservation(prompt="Correct!", reward=1.0, done=True)
        hint = "higher" if not digits or int(digits) < self.secret else "lower"
        return GuessObservation(prompt=hint, reward=0.0)

    @property
    def state(self):
        return self._state


class Hang(Guess):
    """Every step waits until $RLFT_TEST_RELEASE exists, at most $RLFT_TEST_HANG_S seconds."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        until = time.monotonic() + float(os.environ.get("RLFT_TEST_HANG_S", "600"))
        while time.monotonic() < until and not os.path.exists(os.environ.get("RLFT_TEST_RELEASE", "")):
            time.sleep(0.05)
        return super().step(action)


class Alone(Guess):
    SUPPORTS_CONCURRENT_SESSIONS = False


class EchoObservation(Observation):
    echoed: str = ""
    length: int = 0


class Echo(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, **kwargs):
        return EchoObservation()

    def step(self, action: GuessAction) -> EchoObservation:
        return EchoObservation(echoed=action.message, length=len(action.message), reward=0.5)

    @property
    def state(self):
        return State()


class Move(Action):
    column: int


class Note(Action):
    message: str
    comment: str = ""


class Signed(Action):
    message: str
    player: int


app = create_fastapi_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=16)
two_at_a_time = create_fastapi_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=2)
one_at_a_time = create_fastapi_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=1)
numbers = create_fastapi_app(Guess, Move, GuessObservation)
notes = create_fastapi_app(Guess, Note, GuessObservation)
signed = create_fastapi_app(Guess, Signed, GuessObservation)
'''


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    pytest.importorskip("openenv.core", reason="openenv-core is not installed (pip install 'rlft[openenv]')")
    path = tmp_path_factory.mktemp("openenv") / "guess_game.py"
    path.write_text(GAME)
    return path


@pytest.fixture(scope="module")
def tokenizer(qwen_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_path)


def secret(run_seed: int, draw: int, high: int = 16) -> int:
    """The Guess game's secret for a prompt's draw: its reset seeds from the episode's seed."""
    return random.Random(stream_seed(run_seed, "environment", draw) % 2**32).randint(1, high)


def driver_for(tokenizer, ref: str, script: list[str], args=None, **limits):
    engine = ScriptedEngine(tokenizer, script)
    source = load_environment(ref, args or {}, run_seed=0, max_prompt_tokens=512)
    return TurnDriver(engine, tokenizer, [], pick_parser("auto", None), AgentLimits(**limits),
                      environment=source), engine


def test_an_openenv_game_served_in_process_plays_through_the_turn_driver(game, tokenizer):
    """openenv:file.py:Class: reset's observation takes the place of the row's last message; a wrong
    guess is answered with the game's hint as a user message (encoded once, mask 0), the right one
    with its reward and the end; the environment_args reach reset (high); the G episodes of a group
    share a seed but not a session."""
    answer = secret(0, draw=5, high=8)
    wrong = answer % 8 + 1
    driver, engine = driver_for(tokenizer, f"openenv:{game}:Guess", [f"Is it {wrong}?", f"It is {answer}.", "never"],
                                args={"high": 8})
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50), rows=[EpisodeRow("games.jsonl:6", {}, 5)])
    first = [PROMPT[0], {"role": "user", "content": "Guess my number between 1 and 8."}]
    assert ep.prompt_ids == driver.encoder.prompt_ids(first)
    hint = "higher" if wrong < answer else "lower"
    turn1, turn2 = engine.sampled[0][0], engine.sampled[1][0]
    obs = driver.encoder.observation_ids(first, [{"role": "user", "content": hint}], turn1[-1])
    assert ep.completion_ids == turn1 + obs + turn2
    assert ep.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    record = ep.episode
    assert len(engine.contexts) == 2 and record.turns == 2
    assert (record.env_rewards, record.env_done, record.env_final) == ([0.0, 1.0], True, "Correct!")
    assert record.messages == [*first, {"role": "assistant", "content": f"Is it {wrong}?"},
                               {"role": "user", "content": hint}, {"role": "assistant", "content": f"It is {answer}."}]
    metrics = episode_metrics([ep])
    assert metrics["env/return_mean"] == 1.0 and metrics["env/episodes_done"] == 1.0

    # a group: one seed (one secret), two sessions (one episode's guesses do not move the other's game)
    driver, _ = driver_for(tokenizer, f"openenv:{game}:app", [f"{wrong}", f"{answer}"], args={"high": 8})
    episodes = driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50), rows=[EpisodeRow("r:1", {}, 5)])
    assert [e.episode.env_rewards for e in episodes] == [[0.0, 1.0], [0.0, 1.0]]
    assert all(e.episode.messages[1]["content"] == "Guess my number between 1 and 8." for e in episodes)


def test_a_running_server_by_url_and_one_that_stops(game, tokenizer, tmp_path):
    """openenv:http://127.0.0.1:PORT against the game served by uvicorn in a process of its own;
    when that server stops, the next episode stops the run with one message naming the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{game.stem}:app", "--host", "127.0.0.1",
                                   "--port", str(port), "--log-level", "warning"], cwd=game.parent,
                                  stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        answer = secret(0, draw=0)
        driver, _ = driver_for(tokenizer, f"openenv:{url}", [f"{answer % 16 + 1}", f"{answer}"])
        [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))
        assert ep.episode.env_rewards == [0.0, 1.0] and ep.episode.env_done
    finally:
        server.terminate()
        server.wait(timeout=30)
    with pytest.raises(EnvironmentFailed) as info:
        driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50))
    message = str(info.value)
    assert f"environment 'openenv:{url}' on prompt 0: the constructor raised" in message
    assert f"cannot open a session on the OpenEnv server at {url}" in message and "still running?" in message


def test_a_step_past_the_time_limit_ends_its_episode_as_with_built_in_environments(game, tokenizer, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("RLFT_TEST_RELEASE", str(tmp_path / "release"))
    monkeypatch.setenv("RLFT_TEST_HANG_S", "5")  # without a limit: 5 s a step, not forever
    try:
        driver, engine = driver_for(tokenizer, f"openenv:{game}:Hang", ["Is it 3?", "never sampled"],
                                    env_step_timeout_s=0.5)
        start = time.perf_counter()
        episodes = driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50))
        took = time.perf_counter() - start
        assert 1.0 <= took < 4.0, took  # the two steps one after the other, each abandoned at 0.5 s
        assert len(engine.contexts) == 1
        for ep in episodes:
            record = ep.episode
            assert record.env_timed_out and record.env_rewards == [] and not record.env_done
            assert ep.finish_reason == "stop" and record.turns == 1 and ep.loss_mask == [1] * len(ep.completion_ids)
        metrics = episode_metrics(episodes)
        assert metrics["env/step_timeouts"] == 2.0 and metrics["env/episodes_cut"] == 2.0
    finally:
        (tmp_path / "release").touch()  # the abandoned steps return


def test_sessions_close_when_episodes_end_so_a_full_server_serves_rollout_after_rollout(game, tokenizer):
    """A server that admits 2 sessions: rollouts of 2 episodes, done ones (closed at done) and cut
    ones (closed when dropped), one after another; 3 at once is one message with the fix."""
    answer = secret(0, draw=0)
    ref = f"openenv:{game}:two_at_a_time"
    for script, limits in [([f"{answer}"], {}), (["no idea", "still none"], {"max_turns": 2})] * 2:
        driver, _ = driver_for(tokenizer, ref, script, **limits)
        episodes = driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50))
        assert all(len(e.episode.env_rewards) == len(script) for e in episodes)
        del driver, episodes
        gc.collect()
    driver, _ = driver_for(tokenizer, ref, ["1"])
    with pytest.raises(EnvironmentFailed) as info:
        driver.run([PROMPT], SamplingParams(n=3, max_new_tokens=50))
    message = str(info.value)
    assert f"environment '{ref}' on prompt 0: reset raised" in message and "refused the session" in message
    assert "Server at capacity: 2/2" in message and "max_concurrent_envs=N" in message


def test_observations_show_the_one_field_or_json_and_args_choose(game):
    def play(target, args, text):
        source = load_environment(f"openenv:{game}:{target}", args, run_seed=0)
        prompt, [env] = source.start(PROMPT, EpisodeRow("r:1", {}, 0), 1)
        return prompt, env.step(text)

    # Echo's observation has two fields: both, as JSON
    prompt, step = play("Echo", {}, "hello")
    assert prompt == [PROMPT[0], {"role": "user", "content": '{"echoed": "", "length": 0}'}]
    assert json.loads(step.observation) == {"echoed": "hello", "length": 5} and step.reward == 0.5 and not step.done
    # one of them; an empty first observation keeps the row's prompt
    prompt, step = play("Echo", {"observation_field": "echoed"}, "hello")
    assert prompt == PROMPT and step.observation == "hello"
    prompt, step = play("Guess", {"keep_prompt": True}, "1")  # a first observation not shown
    assert prompt == PROMPT and step.observation in ("higher", "Correct!")
    with pytest.raises(ConfigError, match=r"observation_field 'text' is not a field of its observation \(it has: "
                                          r"echoed, length\)"):
        load_environment(f"openenv:{game}:Echo", {"observation_field": "text"}, 0)
    # an action with two text fields: action_field names the one for the turn
    with pytest.raises(ConfigError, match=r"several text fields: name the one .*action_field \(one of message, "
                                          r"comment\)"):
        load_environment(f"openenv:{game}:notes", {}, 0)
    source = load_environment(f"openenv:{game}:notes", {"action_field": "message"}, 0)
    assert source.make.action_field == "message"


def test_what_rlft_cannot_drive_is_one_clear_error_at_start(game, tokenizer):
    with pytest.raises(ConfigError, match=r"(?s)no server answers at http://127.0.0.1:9 \(ConnectError.*"
                                          r"Fix: start the environment's server first"):
        load_environment("openenv:http://127.0.0.1:9", {}, 0)
    # something that answers, but not /schema (kept: the in-process server stops when its source is collected)
    source = load_environment(f"openenv:{game}:app", {}, 0)
    with pytest.raises(ConfigError, match=r"/nope/schema answered 404, not an OpenEnv server's schema"):
        load_environment(f"openenv:{source.make.url}/nope", {}, 0)
    with pytest.raises(ConfigError, match=r"(?s)its action has no text field.*column \(integer\)"):
        load_environment(f"openenv:{game}:numbers", {}, 0)
    with pytest.raises(ConfigError, match=r"its action also requires player"):
        load_environment(f"openenv:{game}:signed", {}, 0)
    with pytest.raises(ConfigError, match=r"Alone does not set SUPPORTS_CONCURRENT_SESSIONS = True"):
        load_environment(f"openenv:{game}:Alone", {}, 0)
    with pytest.raises(ConfigError, match=r"Guess.reset cannot take agent.environment_args \['size'\]"):
        load_environment(f"openenv:{game}:Guess", {"size": 3}, 0)
    with pytest.raises(ConfigError, match=r"drop `seed`"):
        load_environment(f"openenv:{game}:Guess", {"seed": 3}, 0)
    with pytest.raises(ConfigError, match=r"neither an OpenEnv Environment subclass nor the app"):
        load_environment(f"openenv:{game}:GuessAction", {}, 0)
    # a step that raises on the server: the run stops naming the environment, the row and the server's message
    driver, _ = driver_for(tokenizer, f"openenv:{game}:Guess", ["99"])
    with pytest.raises(EnvironmentFailed, match=r"on games.jsonl:4: step raised:\n.*answered step with an error: "
                                                r"the grader fell over \(code: EXECUTION_ERROR\)"):
        driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=50), rows=[EpisodeRow("games.jsonl:4", {}, 0)])
    # a server that admits one session and a group of two
    driver, _ = driver_for(tokenizer, f"openenv:{game}:one_at_a_time", ["1"])
    with pytest.raises(EnvironmentFailed, match=r"reset raised:\n.*refused the session: Server at capacity: 1/1"):
        driver.run([PROMPT], SamplingParams(n=2, max_new_tokens=50))


def test_config_names_openenv_environments_and_says_what_is_missing(tmp_path, monkeypatch):
    from rlft.config import load_config

    base = {"method": "grpo", "output_dir": str(tmp_path / "r"), "model": {"path": "x"}, "data": {"train": "x"},
            "rewards": [{"fn": "environment"}]}
    (tmp_path / "game.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for ref, kept in [("openenv:http://127.0.0.1:8000", "openenv:http://127.0.0.1:8000"),
                      ("openenv:envs.guess.server.app:app", "openenv:envs.guess.server.app:app"),
                      ("openenv:game.py:Guess", f"openenv:{tmp_path / 'game.py'}:Guess")]:
        assert load_config({**base, "agent": {"environment": ref}}).agent.environment == kept
    with pytest.raises(ConfigError, match=r"'openenv:http://HOST:PORT' \(a running server\), 'openenv:module:Class'"):
        load_config({**base, "agent": {"environment": "openenv:"}})
    monkeypatch.setitem(sys.modules, "openenv", None)  # as if openenv-core were not installed
    with pytest.raises(ConfigError, match=r"pip install 'rlft\[openenv\]'"):
        load_environment("openenv:http://127.0.0.1:8000", {}, 0)


def test_grpo_trains_on_an_openenv_game(game, qwen_path, tmp_path):
    from rlft.api import train

    data = write_jsonl(tmp_path / "games.jsonl", [{"prompt": "Play."}] * 4)
    config = {"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
              "model": {"path": str(qwen_path)}, "data": {"train": str(data), "shuffle": False},
              "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "precision": "fp32"},
              # the stop string ends some turns before max_new_tokens: finished actions the game steps on
              "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8, "stop": ["a"]},
              "rewards": [{"fn": "environment"}],
              "agent": {"environment": f"openenv:{game}:Guess", "environment_args": {"high": 4},
                        "max_turns": 2, "max_total_tokens": 48},
              "logging": {"progress": False, "sample_every": 1, "num_samples": 4}}
    summary = train(config)
    assert summary["status"] == "completed" and summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/return_mean" in r]
    assert len(steps) == 2 and all(r["env/episodes_done"] + r["env/episodes_cut"] == 4 for r in steps)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(s["prompt"].startswith("Guess my number between 1 and 4.") for s in samples)
    assert any(s["env_rewards"] for s in samples)  # the game stepped
    for s in samples:
        assert s["components"]["environment"] == pytest.approx(sum(s["env_rewards"]), abs=1e-12)
