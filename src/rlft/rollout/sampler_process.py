"""The hf engine in a child process: an async run's token generation off the trainer's GIL.

With `rollout.async_steps` k > 0 a sampler thread samples beside the trainer. On CPU with small
models both sides are Python-bound, so two threads of one process take turns on the GIL and the
overlap buys little. `ProcessEngine` is an `Engine` whose `generate` runs an `HFEngine` in a
spawned child process, with its own interpreter and `torch.set_num_threads` count. Only token
generation moves: the sampler thread keeps running the turn driver (tools, parsing,
environments), the rewards and the queue, calling this engine per turn.

The child samples from the sampler's copy of the policy, whose storages are moved to shared
memory when the child starts and mapped by it: loading a published snapshot into that copy (the
sampler thread's `copy_`, see training/online/rollouts.py) is the weight push, and
`sync_weights` is a round trip that confirms the child is alive before it samples from them.
The parent never writes the weights while the child reads them: the one sampler thread does
both, in turn. The sampling streams (seed, stream name, call counter) live in the child's
engine; every reply carries them back, so `state_dict` answers even after the child died (a
checkpoint saved on that failure holds the streams as the failed batch's undo left them).

Lifetime: the child ignores SIGINT and leaves the terminal's process group, so a Ctrl-C or a
group-wide SIGTERM reaches only the parent, which stops at a step's end and saves while the
child finishes the batches a checkpoint needs. It exits on `close()`, when its pipe reaches EOF,
or when its parent is gone (it polls the parent's pid), so no child outlives a run, even one
killed with SIGKILL. A child that dies or raises makes the call raise `SamplerProcessFailed`
naming the exit status or the child's exception; the sampler thread's failure path then stops
the run with a checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from rlft.errors import RlftError
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.seeds import check_engine_state

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often each side checks that the other is still there


class SamplerProcessFailed(RlftError):
    """The sampler process died or raised; the message names its exit status or the exception."""


def use_process(setting: str, device: torch.device, several_ranks: bool) -> bool:
    """rollout.sampler for an async run's hf engine: 'auto' is a process on CPU in one process
    (where it was measured faster: the GIL); a thread on GPUs and under torchrun, where the process
    sampler is not tested yet."""
    return setting == "process" or (setting == "auto" and device.type == "cpu" and not several_ranks)


class ProcessEngine:
    """`engine` (an HFEngine on the sampler's own copy of the policy, never the trainer's module)
    moved into a spawned child process: its model's storages become shared memory, and the rest
    of it (tokenizer, settings, stream position) is sent to the child as it is."""

    def __init__(self, engine: Any, threads: int | None = None):
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self._lock = threading.Lock()  # one request in flight; a second caller waits
        self._state = engine.state_dict()
        self._failed: SamplerProcessFailed | None = None
        engine.model.share_memory()  # the child maps these storages: a weight load in the parent is the push
        with _sigint_ignored(), _main_hidden():
            self._process = ctx.Process(target=_serve, args=(child_end, os.getpid()), name="rlft-sampler",
                                        daemon=True)
            self._process.start()
        child_end.close()  # ours: the child's end must close with the child, so a death reads as EOF
        self.pid = self._process.pid
        weakref.finalize(self, _kill, self._process)  # dropped without close() (a failed build): no orphan
        self._call("build", engine, threads or torch.get_num_threads())

    # -- the Engine protocol ------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0,
                 streams: Sequence[str] | None = None) -> list[Completion]:
        return self._call("generate", [list(p) for p in prompts], params, first_prompt,
                          None if streams is None else list(streams))

    def continuous(self, params: SamplingParams) -> "_RemoteBatch | None":
        """The child engine's continuous batch (rollout/continuous.py), driven over the pipe."""
        return _RemoteBatch(self) if self._call("continuous", params) else None

    def sync_weights(self) -> None:
        """The new weights are already in the shared storages (the caller copied them in): confirm
        the child is alive to sample from them (a dead one fails this push, by name)."""
        self._call("sync")

    @contextmanager
    def isolated_rng(self, seed: int) -> Iterator[None]:
        saved = dict(self._state)
        self.load_state_dict({"engine": "hf", "seed": seed, "stream": "isolated", "calls": 0})
        try:
            yield
        finally:
            self.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_engine_state(state, "hf")
        self._state = {key: state[key] for key in ("engine", "seed", "stream", "calls")}
        if self._failed is None:  # a dead child's streams are ours alone (a checkpoint reads them)
            self._call("load_state", self._state)

    def close(self) -> None:
        """Stop the child: asked to exit when no request is in flight, else (the run ends on an error
        while the sampler thread still generates) or when it does not exit, killed."""
        process, self._process = self._process, None
        if process is None:
            return
        if self._lock.acquire(timeout=1.0):
            try:
                if process.is_alive():
                    self._conn.send(("close", ()))
                    process.join(timeout=10)
            except OSError:
                pass
            finally:
                self._lock.release()
        _kill(process)

    # -- the pipe -----------------------------------------------------------------------------
    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            process = self._process  # close() may drop it meanwhile
            if self._failed is not None:
                raise self._failed
            if process is None:
                raise SamplerProcessFailed(f"the sampler process is closed ({op} after close)")
            try:
                self._conn.send((op, args))
                while not self._conn.poll(_POLL_S):
                    if not process.is_alive():
                        raise EOFError
                status, value, state = self._conn.recv()
            except (EOFError, OSError):
                self._failed = SamplerProcessFailed(self._death(process, op))
                raise self._failed from None
            if state is not None:
                self._state = state
        if status == "error":
            kind, text, trace = value
            log.error("the sampler process (pid %d) raised in %s:\n%s", self.pid, op, trace)
            raise SamplerProcessFailed(f"the sampler process (pid {self.pid}) raised {kind}: {text} (in {op})")
        return value

    def _death(self, process: Any, op: str) -> str:
        process.join(timeout=5)
        code = process.exitcode
        if code is None:
            how = "stopped answering (its pipe closed)"
        elif code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"was killed by {name} (exit code {code})"
        else:
            how = f"exited with code {code}"
        during = "a weight push" if op == "sync" else "generation" if op.startswith(("generate", "continuous")) else op
        return f"the sampler process (pid {self.pid}) {how} during {during}"


class _RemoteBatch:
    """The parent's handle on the child's continuous batch: each call one round trip."""

    def __init__(self, engine: ProcessEngine):
        self.engine = engine

    def add(self, requests: list) -> None:
        self.engine._call("continuous_add", requests)

    def step(self, max_steps: int) -> tuple[list, bool]:
        return self.engine._call("continuous_step", max_steps)


def _kill(process: Any) -> None:
    if process.is_alive():
        process.kill()
        process.join()


@contextmanager
def _main_hidden() -> Iterator[None]:
    """Start the child without importing the parent's `__main__` (spawn re-runs it, so a script
    calling `rlft.api.train` without a main guard would train again in the child); it needs only
    this module, and what it is sent is importable by name."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignored at exec, SIGINT stays ignored in the child (Python keeps an inherited SIG_IGN), so a
    Ctrl-C during its imports stays the parent's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- the child ----------------------------------------------------------------------------------
def _serve(conn: Any, parent: int) -> None:
    """The child's loop: one request at a time, answered with (status, value, engine state)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setsid()  # out of the terminal's process group: group signals are the parent's to handle
    except OSError:
        pass
    engine = batch = None
    while True:
        try:
            while not conn.poll(_POLL_S):
                if os.getppid() != parent:  # the parent died (we were reparented)
                    return
            op, args = conn.recv()
        except (EOFError, OSError):  # the parent closed its end or died
            return
        if op == "close":
            return
        try:
            if op == "build":
                engine, threads = args
                torch.set_num_threads(threads)
                value = None
            elif op == "generate":
                value = engine.generate(*args)
            elif op == "continuous":
                batch = engine.continuous(*args)
                value = batch is not None
            elif op == "continuous_add":
                batch.add(*args)
                value = None
            elif op == "continuous_step":
                value = batch.step(*args)
            elif op == "load_state":
                engine.load_state_dict(args[0])
                value = None
            elif op == "sync":
                value = None  # the weights are in the shared storages already
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = ("ok", value, None if engine is None else engine.state_dict())
        except Exception as exc:  # sent back: the parent raises it by name
            reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()),
                     None if engine is None else engine.state_dict())
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return

