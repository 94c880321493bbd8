"""Seeds for sampling that do not depend on how completions are batched.

Each completion draws from its own stream, named by (run seed, stream, generate call, the global
index of the completion): the same prompt gets the same samples whether it is generated alone, in
a batch, or on another rank of a distributed run -- and a resumed run continues the same streams.
A later turn of a multi-turn episode draws from a stream named by the episode instead (its global
prompt index, sample and turn) within the call its first turn made (see `Engine.generate`).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from rlft.errors import ResumeError


def stream_seed(seed: int, stream: str, call: int, index: int | str = 0) -> int:
    """A 56-bit seed: a stable hash (the same across processes and runs, unlike `hash()`)."""
    digest = hashlib.sha256(f"rlft-sample:{seed}:{stream}:{call}:{index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def named_stream_seed(seed: int, stream: str, call: int, name: str, sample: int = 0) -> int:
    """The seed of a named stream (an episode's later turn); never that of an indexed one."""
    return stream_seed(seed, stream, call, f"named:{name}:{sample}")


def call_number(calls: int, streams: Sequence[str] | None) -> tuple[int, int]:
    """(this generate call's number, the engine's call count after it): a call with named streams
    is a later turn of the previous call's episodes, so it continues that call's number."""
    return (calls, calls + 1) if streams is None else (calls - 1, calls)


def request_seeds(seed: int, stream: str, call: int, prompts: int, n: int, first_prompt: int = 0,
                  streams: Sequence[str] | None = None) -> list[int]:
    """One seed per completion, grouped by prompt: completion k of prompt i draws from stream
    (first_prompt + i) * n + k, or from the named stream (streams[i], k) of a later turn."""
    if streams is not None:
        if len(streams) != prompts:
            raise ValueError(f"{len(streams)} stream names for {prompts} prompts: give one per prompt")
        return [named_stream_seed(seed, stream, call, streams[i], k) for i in range(prompts) for k in range(n)]
    return [stream_seed(seed, stream, call, (first_prompt + i) * n + k) for i in range(prompts) for k in range(n)]


def check_engine_state(state: dict, engine: str) -> None:
    """A checkpoint's rollout state must come from the same kind of engine."""
    if state.get("engine") != engine:
        raise ResumeError(f"the checkpoint's rollout state was written by another engine (rollout.engine "
                          f"{state.get('engine', 'of an older rlft')!r}, this run: {engine!r}); resume with the "
                          "same rollout.engine, or start a new run")


class SamplingStreams:
    """An engine's position in its sampling streams (run seed, stream name, call counter): what an
    evaluation sets aside and a checkpoint saves. `STATE_NAME` names the streams in a checkpoint; a
    resume refuses another engine's."""

    STATE_NAME = ""
    _seed: int
    _stream: str
    _calls: int

    @contextmanager
    def isolated_rng(self, seed: int) -> Iterator[None]:
        """Sample from streams seeded with `seed` (the same completions at every eval), then return
        to the training streams where they were: evals never change the training trajectory."""
        saved = self._seed, self._stream, self._calls
        self._seed, self._stream, self._calls = seed, "isolated", 0
        try:
            yield
        finally:
            self._seed, self._stream, self._calls = saved

    def state_dict(self) -> dict[str, Any]:
        return {"engine": self.STATE_NAME, "seed": self._seed, "stream": self._stream, "calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_engine_state(state, self.STATE_NAME)
        self._seed, self._stream, self._calls = state["seed"], state["stream"], state["calls"]
