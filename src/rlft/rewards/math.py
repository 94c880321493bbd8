"""The `math` reward: extract the final answer from a completion and check it with math-verify.

Extraction (first that applies): `\\boxed{...}` with balanced braces; "final answer is X" /
"answer is X" / "Answer: X"; else the last number. Several *different* boxed answers are a hedge
and score 0 (`\\boxed{3} or \\boxed{5}` must not pass for 3).

Checking never runs sympy on model text in the trainer process: math-verify's own timeout uses
signal.alarm, which only works on the main thread, while the scorer calls rewards from a thread
pool. So parse/verify run in a few worker processes (fresh interpreters, never forks of the
trainer) with a per-call deadline; a worker that overruns (`\\boxed{9^{9^{9^{9}}}}`) is killed and
replaced. Plain numbers on both sides (integers, decimals, a/b, \\frac{a}{b}) are compared in
process with exact fractions; decimals follow math-verify's rule (equal after rounding to 6
places), and the near-ties that rounding could decide either way go to the workers.

Equivalence is math-verify's: `\\frac13` equals `0.333333` (floats compared at 6 decimals), sets
must match exactly (`1, 2` is not `1, 2, 3`), `\\pm 2021` is the set {-2021, 2021}, not 2021.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Any

from rlft.rewards.scoring import RewardFn, register_reward

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
HEDGE = "<hedged>"


def boxed_contents(text: str) -> list[str]:
    """Contents of every outermost \\boxed{...} (balanced braces; an unclosed one is ignored)."""
    out, end = [], 0
    for m in _BOXED.finditer(text):
        if m.start() < end:  # nested in the previous box: part of its content
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1].strip())
            end = i
    return out


def _clean(answer: str) -> str:
    answer = answer.strip().strip("*").strip()
    answer = re.split(r"\.\s", answer, maxsplit=1)[0]  # "42. Hope this helps" -> "42"
    return answer.strip().rstrip(".").strip().strip("$").strip()


def extract_answer(completion: str) -> str | None:
    """The completion's final answer as a string; HEDGE for several different boxed answers.

    >>> extract_answer("so x = 2, and the final answer is $\\\\frac{1}{2}$.")
    '\\\\frac{1}{2}'
    """
    boxed = boxed_contents(completion)
    if boxed:
        distinct = {re.sub(r"\s+", "", b) for b in boxed}
        return boxed[-1] if len(distinct) == 1 else HEDGE
    phrases = _ANSWER_PHRASE.findall(completion)
    if phrases and _clean(phrases[-1]):
        return _clean(phrases[-1])
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def gold_answer(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    if "####" in text:  # GSM8K-style "reasoning #### 42"
        text = text.rsplit("####", 1)[1].strip()
    boxed = boxed_contents(text)
    if boxed:
        text = boxed[-1]
    text = text.strip().strip("$").strip()
    return text or None


# ------------------------------------------------------------------------------ fast path

_PLAIN = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FRAC = re.compile(r"(-?)\\[dt]?frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))")
_SLASH = re.compile(r"(-?\d+)\s*/\s*(\d+)")


def plain_number(text: str) -> tuple[Fraction, bool] | None:
    """(value, has_decimal_point) for an integer, decimal, a/b or \\frac{a}{b}; else None."""
    text = text.strip()
    if len(text) > 100:
        return None
    try:
        if _PLAIN.fullmatch(text):
            return Fraction(text.replace(",", "")), "." in text
        if m := _SLASH.fullmatch(text):
            return Fraction(int(m.group(1)), int(m.group(2))), False
        if m := _FRAC.fullmatch(text):
            num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
            return Fraction(-num if m.group(1) else num, den), False
    except (ValueError, ZeroDivisionError):
        return None
    return None


def fast_compare(gold: str, answer: str) -> bool | None:
    """True/False when both are plain numbers and the result is certain; None to ask math-verify."""
    g, a = plain_number(gold), plain_number(answer)
    if g is None or a is None:
        return None
    (gv, g_dec), (av, a_dec) = g, a
    if gv == av:
        return True
    if not (g_dec or a_dec):
        return False  # exact rationals: math-verify compares them exactly too
    # math-verify rounds floats to 6 decimals: values more than 1e-6 apart never round equal.
    return False if abs(gv - av) > Fraction(1, 10**6) else None


# ------------------------------------------------------------------------------ worker pool

def serve_worker() -> None:
    """Worker loop (runs in its own interpreter): JSON lines in, JSON lines out."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway sympy power fails, not the host
    logging.disable(logging.WARNING)  # math-verify warns on every call that we disabled its alarm
    from functools import lru_cache

    from math_verify import parse, verify

    def wrap(s: str) -> str:
        return "$" + s.strip().strip("$") + "$"

    @lru_cache(maxsize=1024)  # a group of G samples shares one gold answer
    def parse_gold(s: str):
        return parse(wrap(s), parsing_timeout=None)

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            gold = parse_gold(req["gold"])
            if all(isinstance(g, str) for g in gold):  # only the raw-text fallback: not math
                reply = {"verdict": None, "why": "gold answer does not parse"}
            else:
                pred = parse(wrap(req["answer"]), parsing_timeout=None)
                reply = {"verdict": bool(pred) and bool(verify(gold, pred, timeout_seconds=None))}
        except Exception as exc:  # sympy raises all sorts on odd input: the answer is not verified
            reply = {"verdict": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rlft.rewards.math import serve_worker; serve_worker()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buf = b""

    def read_line(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class VerifierPool:
    """A few math-verify worker processes; `check` is thread-safe and bounded by its timeout once
    it holds a worker (waiting for a free worker is bounded by `queue_timeout`)."""

    def __init__(self, size: int = 2, start_timeout: float = 120.0, queue_timeout: float = 120.0):
        self.size, self.start_timeout, self.queue_timeout = size, start_timeout, queue_timeout
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        worker = _Worker()
        with self._lock:
            self._live.add(worker)
        threading.Thread(target=self._await_ready, args=(worker,), daemon=True).start()

    def _await_ready(self, worker: _Worker) -> None:
        hello = worker.read_line(time.monotonic() + self.start_timeout)
        if hello and hello.get("ready") and not self._closed:
            self._idle.put(worker)
            return
        if not self._closed:
            log.error("a math-verify worker did not start within %.0fs (is math-verify installed?)", self.start_timeout)
        self._retire(worker)

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._live]

    def check(self, gold: str, answer: str, timeout: float) -> dict:
        """{"verdict": True/False/None, "why": ...}; verdict None = could not be decided here."""
        worker, end = None, time.monotonic() + self.queue_timeout
        while worker is None:
            with self._lock:
                if not self._live:  # every worker failed to start: say so now, not after the wait
                    return {"verdict": None, "why": "no math-verify worker is running"}
            if time.monotonic() > end:
                return {"verdict": None, "why": "no math-verify worker free"}
            try:
                worker = self._idle.get(timeout=0.5)
            except queue.Empty:
                pass
        try:
            worker.proc.stdin.write((json.dumps({"gold": gold, "answer": answer}) + "\n").encode())
            worker.proc.stdin.flush()
            reply = worker.read_line(time.monotonic() + timeout)
        except (OSError, ValueError):
            reply = None
        if reply is not None:
            self._idle.put(worker)
            return reply
        # Overran (or died): kill it, start a fresh one, and call the answer wrong, since a
        # model answer that sympy cannot settle in time is not a verified answer.
        self._retire(worker)
        if not self._closed:
            self._spawn()
        return {"verdict": False, "why": f"math-verify took longer than {timeout}s"}

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._live)
        for w in workers:
            self._retire(w)


_pools: dict[int, VerifierPool] = {}
_pools_lock = threading.Lock()


def verifier_pool(size: int = 2) -> VerifierPool:
    with _pools_lock:
        if size not in _pools:
            _pools[size] = VerifierPool(size)
        return _pools[size]


@atexit.register
def _close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()


# ------------------------------------------------------------------------------ the reward

def check_answer(gold: str, answer: str | None, timeout: float = 5.0, workers: int = 2,
                 max_answer_chars: int = 1000) -> float | None:
    """1.0 / 0.0, or None when the gold answer cannot be parsed (or no worker is free)."""
    if answer is None or answer == HEDGE or not answer.strip() or len(answer) > max_answer_chars:
        return 0.0
    if re.sub(r"\s+", "", gold) == re.sub(r"\s+", "", answer):
        return 1.0
    fast = fast_compare(gold, answer)
    if fast is not None:
        return float(fast)
    verdict = verifier_pool(workers).check(gold, answer, timeout)["verdict"]
    return None if verdict is None else float(verdict)


@register_reward("math")
def math_reward(field: str = "answer", timeout: float = 5.0, workers: int = 2,
                max_answer_chars: int = 1000) -> RewardFn:
    """1.0 when the completion's final answer equals row[field] (math-verify equivalence), else
    0.0; None when the row has no usable gold answer. Answers longer than `max_answer_chars`
    score 0 without being parsed.

    >>> math_reward()("q", "so the answer is 42.", answer="42")
    1.0
    """
    if timeout <= 0 or workers < 1 or max_answer_chars < 1:
        raise ValueError(f"math reward: need timeout > 0, workers >= 1, max_answer_chars >= 1; got "
                         f"timeout={timeout}, workers={workers}, max_answer_chars={max_answer_chars}")

    def reward(prompt: str, completion: str, **row: Any) -> float | None:
        gold = gold_answer(row.get(field))
        if gold is None:
            return None
        return check_answer(gold, extract_answer(completion), timeout, workers, max_answer_chars)

    reward.required_fields = (field,)
    return reward
