"""The environments of gem-llm (GEM, "a gym for agentic LLMs") by name: `agent.environment:
gem:game:GuessTheNumber-v0-easy`, with `agent.environment_args` passed to `gem.make`.

GEM's API is gym's: `reset(seed) -> (observation, info)` and `step(action) -> (observation,
reward, terminated, truncated, info)`. Its games keep the board in `info["suffix"]` ("Here is the
current board layout: ..."), which GEM's own observation wrappers append to every observation; so
does this adapter, except after the last step (nothing follows it). `done` is terminated or
truncated.

GEM's games draw from Python's and numpy's global generators (`reset(seed)` seeds both). Each
instance here keeps its own copy of that global state and swaps it in around each call: a game
never moves the trainer's generators, and an episode depends on its seed alone, not on the order
other episodes were stepped in. (Tool threads still running during a call would see the game's
state; the calls themselves run one at a time.)
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import random
from typing import Any, Callable, Iterator

from rlft.errors import ConfigError

INSTALL_HINT = "agent.environment 'gem:...' needs the gem-llm package: pip install 'rlft[gem]'"


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """The root logger's handlers and level put back as they were: GEM (and verifiers) configure it
    on import (INFO to stderr), which would print every library's INFO lines in the trainer's console."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


def import_quietly(name: str, install_hint: str) -> Any:
    """The optional package `name`, the root logger kept (`root_logging_kept`); a ConfigError with
    `install_hint` when it is not installed."""
    with root_logging_kept():
        try:
            return importlib.import_module(name)
        except ImportError:
            raise ConfigError(install_hint) from None


def import_gem() -> Any:
    return import_quietly("gem", INSTALL_HINT)


def gem_factory(env_id: str, args: dict[str, Any]) -> Callable[[int], "GemEnvironment"]:
    """Checks the id against GEM's registry now, before training starts."""
    gem = import_gem()
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        games = sorted(ENV_REGISTRY)
        guess = difflib.get_close_matches(env_id, games, n=3)
        hint = f" Did you mean {', '.join(map(repr, guess))}?" if guess else ""
        listed = ", ".join(g for g in games if g.startswith("game:"))
        raise ConfigError(f"agent.environment 'gem:{env_id}': gem-llm has no environment {env_id!r}.{hint}\n"
                          f"Its games: {listed}")
    return lambda seed: GemEnvironment(gem, env_id, seed, args)


class GemEnvironment:
    """One GEM environment as an rlft environment (see rollout/agent/environments.py)."""

    def __init__(self, gem: Any, env_id: str, seed: int, args: dict[str, Any]):
        import numpy as np

        self.seed = seed % 2**32  # numpy's legacy seeding takes 32 bits
        self._state = (random.Random(self.seed).getstate(), np.random.RandomState(self.seed).get_state())
        with self._own_rng():
            self.env = gem.make(env_id, **args)

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        import numpy as np

        outer = (random.getstate(), np.random.get_state())
        random.setstate(self._state[0])
        np.random.set_state(self._state[1])
        try:
            yield
        finally:
            self._state = (random.getstate(), np.random.get_state())
            random.setstate(outer[0])
            np.random.set_state(outer[1])

    def reset(self, **row: Any) -> str:
        with self._own_rng():
            observation, info = self.env.reset(seed=self.seed)
        return _with_suffix(observation, info)

    def step(self, text: str) -> tuple[str, float, bool]:
        with self._own_rng():
            observation, reward, terminated, truncated, info = self.env.step(text)
        done = bool(terminated or truncated)
        return (observation if done else _with_suffix(observation, info)), float(reward), done


def _with_suffix(observation: str, info: dict[str, Any]) -> str:
    suffix = info.get("suffix") if isinstance(info, dict) else None
    if not suffix:
        return observation
    return observation + ("" if observation.endswith("\n") else "\n") + suffix
