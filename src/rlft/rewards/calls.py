"""Running reward code the trainer does not control: a time limit per call, waiting that a stop
request (Ctrl-C) can cut short, and a cap on what the calls print.

Python threads cannot be killed, so each call runs on a thread of its own, started as a daemon:
a call past its time limit is abandoned (whatever it returns later is dropped) and the next call
gets a fresh thread. Daemon threads never keep the process alive; `concurrent.futures` workers
are joined at interpreter exit, so one call hung there blocks the shutdown forever.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

# How often a wait looks at the stop request: a Ctrl-C during scoring is acted on within this.
POLL_S = 0.1
# What one reward may print per scoring call before the rest is counted instead of shown: enough
# for debugging prints of a few samples, not a flood that buries the progress lines.
MAX_SHOWN_OUTPUT = 10_000


class ScoringInterrupted(Exception):
    """The run was asked to stop while rewards were being computed (or an agent environment's call
    ran: rollout/agent/environments.py waits the same way); the step is abandoned."""


@dataclass
class Outcome:
    """How one call ended: a value, an exception (BaseException: sys.exit() in a reward is one),
    or past its time limit (`timed_out`; the call may still be running on its abandoned thread)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


def call_all(thunks: Sequence[Callable[[], Any]], max_workers: int, timeout_s: float,
             should_stop: Callable[[], bool] | None = None,
             on_outcome: Callable[[int, Outcome], None] | None = None,
             output: "CappedOutput | None" = None) -> list[Outcome]:
    """Run every thunk with at most `max_workers` running at once (abandoned calls do not count),
    each stopped waiting for after `timeout_s` seconds from its own start.

    `on_outcome(i, outcome)` sees each outcome as it arrives, on the calling thread; an exception
    it raises ends the wait (calls still running are abandoned). `should_stop()` is checked every
    POLL_S seconds; when it returns True, ScoringInterrupted is raised.
    """
    outcomes: list[Outcome | None] = [None] * len(thunks)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    pending = collections.deque(range(len(thunks)))
    running: dict[int, float] = {}  # index -> start time (monotonic)

    def worker(i: int) -> None:
        start = time.monotonic()
        _thread_output.sink = output
        try:
            out = Outcome(value=thunks[i]())
        except BaseException as exc:  # noqa: BLE001  (SystemExit from a reward must not vanish)
            out = Outcome(error=exc)
        out.seconds = time.monotonic() - start
        finished.put((i, out))

    def settle(i: int, out: Outcome) -> None:
        del running[i]
        outcomes[i] = out
        if on_outcome is not None:
            on_outcome(i, out)

    max_workers = max(1, max_workers)
    while pending or running:
        while pending and len(running) < max_workers:
            i = pending.popleft()
            running[i] = time.monotonic()
            threading.Thread(target=worker, args=(i,), daemon=True, name=f"rlft-reward-{i}").start()
        wait = min(POLL_S, max(0.0, min(running.values()) + timeout_s - time.monotonic()))
        try:
            i, out = finished.get(timeout=wait)
            if i in running:  # a late answer from an abandoned call is dropped
                settle(i, out)
        except queue.Empty:
            pass
        if should_stop is not None and should_stop():
            raise ScoringInterrupted()
        now = time.monotonic()
        for i, started in sorted(running.items(), key=lambda kv: kv[1]):
            if now - started >= timeout_s:
                settle(i, Outcome(timed_out=True, seconds=now - started))
    return outcomes  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Output of reward calls

_thread_output = threading.local()  # .sink: the CappedOutput of the call running on this thread


class CappedOutput:
    """What one reward prints during one scoring call: the first `limit` characters go through
    to the real stream, the rest is only counted (and reported once)."""

    def __init__(self, limit: int = MAX_SHOWN_OUTPUT):
        self.limit, self.shown, self.dropped = limit, 0, 0
        self._lock = threading.Lock()

    def write(self, real: Any, text: str) -> None:
        with self._lock:
            room = max(self.limit - self.shown, 0)
            head, rest = text[:room], text[room:]
            self.shown += len(head)
            self.dropped += len(rest)
        if head:
            real.write(head)


class _RoutedStream:
    """Stands in for sys.stdout / sys.stderr while rewards run: text written by a reward thread goes
    through that call's CappedOutput; every other thread (the progress display, the trainer)
    writes to the real stream as before."""

    def __init__(self, real: Any):
        self._real = real

    def write(self, text: str) -> int:
        sink = getattr(_thread_output, "sink", None)
        if sink is None:
            return self._real.write(text)
        sink.write(self._real, text)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding, fileno, ...
        return getattr(self._real, name)


class routed_output:
    """Context manager: route sys.stdout / sys.stderr through _RoutedStream while scoring."""

    def __enter__(self) -> "routed_output":
        self._saved = (sys.stdout, sys.stderr)
        if not isinstance(sys.stdout, _RoutedStream):
            sys.stdout = _RoutedStream(sys.stdout)
        if not isinstance(sys.stderr, _RoutedStream):
            sys.stderr = _RoutedStream(sys.stderr)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.stdout, sys.stderr = self._saved
