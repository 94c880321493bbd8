"""Seeds for sampling that do not depend on how completions are batched.

Each completion draws from its own stream, named by (run seed, stream, generate call, the global
index of the completion): the same prompt gets the same samples whether it is generated alone, in
a batch, or on another rank of a distributed run -- and a resumed run continues the same streams.
"""

from __future__ import annotations

import hashlib


def stream_seed(seed: int, stream: str, call: int, index: int = 0) -> int:
    """A 56-bit seed: a stable hash (the same across processes and runs, unlike `hash()`)."""
    digest = hashlib.sha256(f"rlft-sample:{seed}:{stream}:{call}:{index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def check_engine_state(state: dict, engine: str) -> None:
    """A checkpoint's rollout state must come from the same kind of engine."""
    if state.get("engine") != engine:
        from rlft.errors import ResumeError

        raise ResumeError(f"the checkpoint's rollout state was written by another engine (rollout.engine "
                          f"{state.get('engine', 'of an older rlft')!r}, this run: {engine!r}); resume with the "
                          "same rollout.engine, or start a new run")
