"""Environments: what answers an assistant turn that is not a tool call (a game, a simulated user,
a grader that talks back).

An environment is a class; the turn driver makes one instance per episode and calls it:

    env = Class(seed=..., **agent.environment_args)
    env.reset(**row) -> str | None             # the first observation, or None: keep the row's prompt
    env.step(text) -> (observation, reward, done)   # after each assistant turn without tool calls

`row` is the prompt row's fields (everything but the prompt) plus `messages`, the row's
conversation. A first observation takes the place of the row's last message (its system prompt
and earlier turns stay); each later observation is a `user` message, inserted like a tool result
(encoded once, never trained on), until `done`. The observation that comes with `done` is not
shown: nothing follows it. Config names environments like rewards: `module:Class`,
`path/file.py:Class`, `gem:<env id>` for the games of the gem-llm package (rollout/agent/gem_env.py),
or `openenv:URL` / `openenv:module:Class` for OpenEnv's (rollout/agent/openenv_env.py).

Seeds: the G episodes of a group get the same seed (a function of the run's seed and the prompt's
draw number, so a resumed run replays them), hence the same start (e.g. the same secret number):
the group baseline then compares answers to one game, not luck across games. An environment draws
randomness only from its `seed`; resets of one seed that differ stop the run.

A constructor, `reset` or `step` that raises (or returns what the protocol does not allow) stops
the run with one message naming the environment, the row and the exception; the online loop saves
the last completed step first, as for a reward that raises. Calls run one at a time, each on a
thread of its own that the driver waits on the way it waits on rewards (rewards/calls.py): with a
time limit on `reset` and `step` (agent.env_step_timeout_s; a late call is abandoned, its thread
left to finish in the background), and a stop request (Ctrl-C) ends the wait at once
(ScoringInterrupted: the loop abandons the step and saves the last completed one). The constructor
has no time limit (it may load data the first time) but is interruptible alike.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rlft.errors import ConfigError, EnvironmentFailed
from rlft.models.template import Messages
from rlft.rewards.calls import call_all
from rlft.rewards.user_code import describe_exception, indent, load_user_function, source_file
from rlft.rollout.agent.gem_env import gem_factory
from rlft.rollout.agent.openenv_env import openenv_factory
from rlft.rollout.seeds import stream_seed

GEM_PREFIX = "gem:"
OPENENV_PREFIX = "openenv:"
_PROTOCOL = ("class MyEnv:\n    def __init__(self, seed: int, **args): ...\n"
             "    def reset(self, **row) -> str | None: ...   # first observation (None: the row's prompt)\n"
             "    def step(self, text: str) -> tuple[str, float, bool]: ...   # observation, reward, done")


class Environment(Protocol):
    def reset(self, **row: Any) -> str | None: ...

    def step(self, text: str) -> tuple[str, float, bool]: ...


@dataclass(frozen=True)
class EpisodeRow:
    """What an environment is started from: the prompt row (`where` names it in messages) and its
    draw number in the run (the prompts drawn before it), which names its seed."""

    where: str
    fields: dict[str, Any] = field(default_factory=dict)
    draw: int = 0


def default_rows(count: int, first_prompt: int) -> list[EpisodeRow]:
    """Rows for prompts given without theirs (no fields), numbered from `first_prompt`."""
    return [EpisodeRow(f"prompt {first_prompt + i}", {}, first_prompt + i) for i in range(count)]


# what `EnvironmentSource.guarded` returns for a call that did not return in time
LATE = object()


@dataclass(frozen=True)
class EnvStep:
    observation: str
    reward: float
    done: bool


class EnvironmentSource:
    """Makes an episode's instance, checked: `start` for a group, then `EpisodeEnv.step`."""

    def __init__(self, ref: str, make: Callable[[int], Any], run_seed: int, user_file: str | None = None,
                 max_prompt_tokens: int | None = None):
        self.ref, self.make, self.run_seed = ref, make, run_seed
        self.user_file, self.max_prompt_tokens = user_file, max_prompt_tokens

    def start(self, messages: Messages, row: EpisodeRow, n: int, timeout_s: float = math.inf,
              should_stop: Callable[[], bool] | None = None) -> tuple[Messages, list["EpisodeEnv"]]:
        """n instances for one prompt's group (one seed), reset: the group's prompt and episodes.
        Each reset gets `timeout_s` (one that is late stops the run: its episodes have no prompt)."""
        seed = stream_seed(self.run_seed, "environment", row.draw)
        envs = [EpisodeEnv(self, self.guarded(row, "the constructor", lambda: self.make(seed), should_stop=should_stop),
                           row) for _ in range(n)]
        kwargs = {**row.fields, "messages": messages}
        # each reset gets its own copy: one that edits the row in place cannot change what the next one sees
        firsts = []
        for e in envs:
            first = self.guarded(row, "reset", lambda e=e: e.env.reset(**copy.deepcopy(kwargs)), timeout_s, should_stop)
            if first is LATE:
                raise self.failed(row, f"reset did not return within {timeout_s:g} s (agent.env_step_timeout_s)",
                                  "make reset return sooner (run it by hand on this row to see where it waits), or "
                                  "raise agent.env_step_timeout_s")
            firsts.append(first)
        for first in firsts:
            if first is not None and not isinstance(first, str):
                raise self.failed(row, f"reset returned {_show(first)}; it returns the first observation (str) or "
                                       "None to keep the row's prompt")
        if any(f != firsts[0] for f in firsts):
            raise self.failed(row, "reset gave different first observations to episodes of one seed: it draws "
                                   "randomness that does not come from its `seed` argument, so episodes cannot be "
                                   "replayed (exact resume)", "draw from random.Random(seed) made in __init__")
        if firsts[0] is None:
            return list(messages), envs
        return [*messages[:-1], {"role": "user", "content": firsts[0]}], envs

    def check_prompt(self, row: EpisodeRow, tokens: int) -> None:
        """A first observation makes the prompt: it must fit data.max_prompt_length like a row's."""
        if self.max_prompt_tokens is not None and tokens > self.max_prompt_tokens:
            raise self.failed(row, f"the first observation makes the prompt {tokens} tokens, longer than "
                                   f"data.max_prompt_length ({self.max_prompt_tokens})",
                              "raise data.max_prompt_length, or make reset's observation shorter")

    def guarded(self, row: EpisodeRow, what: str, fn: Callable[[], Any], timeout_s: float = math.inf,
                should_stop: Callable[[], bool] | None = None) -> Any:
        """fn()'s value, or LATE when it did not return within `timeout_s` (abandoned on its
        thread). Raises EnvironmentFailed when it raised, ScoringInterrupted when `should_stop()`
        turned true while it ran."""
        [outcome] = call_all([fn], 1, timeout_s, should_stop)
        if outcome.timed_out:
            return LATE
        if outcome.error is not None:  # the environment's own code: named, with the row
            detail = indent(describe_exception(outcome.error, self.user_file))
            raise self.failed(row, f"{what} raised:\n{detail}") from None
        return outcome.value

    def failed(self, row: EpisodeRow, problem: str, fix: str = "") -> EnvironmentFailed:
        fix = fix or "correct the environment for this row (run its reset/step by hand on it)"
        return EnvironmentFailed(f"environment {self.ref!r} on {row.where}: {problem}\nFix: {fix}")


class EpisodeEnv:
    """One episode's instance; `step` checks what the environment returns."""

    def __init__(self, source: EnvironmentSource, env: Any, row: EpisodeRow):
        self.source, self.env, self.row = source, env, row

    def step(self, text: str, timeout_s: float = math.inf,
             should_stop: Callable[[], bool] | None = None) -> EnvStep | None:
        """The checked step, or None when it did not return within `timeout_s` (the instance is
        then still inside it: it takes no further step)."""
        out = self.source.guarded(self.row, "step", lambda: self.env.step(text), timeout_s, should_stop)
        if out is LATE:
            return None
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise self.source.failed(self.row, f"step returned {_show(out)}; it returns (observation: str, reward: "
                                               "float, done: bool)")
        observation, reward, done = out
        if not isinstance(done, (bool, numbers.Integral)):
            raise self.source.failed(self.row, f"step's done is {_show(done)}, not a bool")
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise self.source.failed(self.row, f"step's reward is {_show(reward)}, not a finite number")
        if observation is None and done:  # nothing follows the last step, so it need not say anything
            observation = ""
        if not isinstance(observation, str):
            raise self.source.failed(self.row, f"step's observation is {_show(observation)}, not text")
        return EnvStep(observation, float(reward), bool(done))


def hub_module_name(target: str) -> str:
    """The module an environment id names, by the Environments Hub's rule (verifiers'): a hub id
    `owner/name@version` is the installed `name`, dashes as underscores.

    >>> hub_module_name("primeintellect/vf-math@0.1.2")
    'vf_math'
    """
    return target.replace("-", "_").split("/")[-1].split("@")[0]


def load_environment(ref: str, args: dict[str, Any], run_seed: int,
                     max_prompt_tokens: int | None = None) -> EnvironmentSource:
    """`module:Class`, `file.py:Class`, `gem:<env id>` or `openenv:<URL | module:Class | module:app>`,
    checked before training starts."""
    if ref.startswith(GEM_PREFIX):
        return EnvironmentSource(ref, gem_factory(ref[len(GEM_PREFIX):], args), run_seed, None, max_prompt_tokens)
    if ref.startswith("verifiers:"):  # agent_driver runs these as agent programs (rollout/agent/verifiers_env.py)
        raise ConfigError(f"agent.environment {ref!r}: a verifiers environment runs its own rollouts; it is not "
                          "stepped by the turn driver")
    if ref.startswith(OPENENV_PREFIX):
        return EnvironmentSource(ref, openenv_factory(ref[len(OPENENV_PREFIX):], args), run_seed, None,
                                 max_prompt_tokens)

    cls = load_user_function(ref, what="agent.environment")
    check_environment_class(cls, ref, args)
    return EnvironmentSource(ref, lambda seed: cls(seed=seed, **args), run_seed, source_file(cls), max_prompt_tokens)


def check_environment_class(cls: Any, ref: str, args: dict[str, Any]) -> None:
    """One ConfigError naming the class when it cannot serve as an environment."""
    def fail(problem: str) -> ConfigError:
        return ConfigError(f"agent.environment {ref!r}: {problem}\nAn environment is a class:\n{_PROTOCOL}")

    if not inspect.isclass(cls):
        raise fail(f"is a {type(cls).__name__}, not a class (rlft makes one instance per episode)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise fail(f"class {cls.__name__} has no {' or '.join(missing)} method")
    for name in ("reset", "step"):
        if inspect.iscoroutinefunction(getattr(cls, name)):
            raise fail(f"{cls.__name__}.{name} is async (async def); the driver calls it and needs the value")
    try:
        inspect.signature(cls).bind(seed=0, **args)
    except TypeError as exc:
        raise fail(f"{cls.__name__} cannot be made as {cls.__name__}(seed=..., **agent.environment_args "
                   f"{sorted(args)}): {exc}") from None
    except ValueError:  # no signature to read (a C class): it fails, if at all, at the first episode
        pass


def env_counts(records: list[Any]) -> dict[str, float]:
    """What `env_metrics` divides, over the episodes that had an environment: sums, which add up
    over ranks (rollout.turns.episode_counts)."""
    played = [r for r in records if r.env_rewards is not None]
    return {"env/played": float(len(played)), "env/return_sum": float(sum(sum(r.env_rewards) for r in played)),
            "env/steps": float(sum(len(r.env_rewards) for r in played)),
            "env/done": float(sum(r.env_done for r in played)),
            "env/timed_out": float(sum(r.env_timed_out for r in played)),
            "env/inserted_tokens": float(sum(r.env_tokens for r in played))}


def env_metrics(counts: dict[str, float]) -> dict[str, float]:
    """A step's environment metrics from `env_counts` (summed over ranks): the mean return (sum of
    step rewards), steps per episode, how many ended with `done` vs were cut (turn or token limit, or a
    step past agent.env_step_timeout_s), and how many of them the time limit cut."""
    n = counts.get("env/played", 0.0)
    if not n:
        return {}
    done = counts["env/done"]
    return {"env/return_mean": counts["env/return_sum"] / n, "env/steps_mean": counts["env/steps"] / n,
            "env/episodes_done": done, "env/episodes_cut": n - done, "env/step_timeouts": counts["env/timed_out"],
            "env/inserted_tokens_mean": counts["env/inserted_tokens"] / n}


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"
