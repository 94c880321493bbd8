"""The `math` reward: extraction, the in-process fast path, golden cases against math-verify,
thread safety, and bounded time on hostile answers."""

import random
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from rlft.rewards.scoring import BUILTIN_REWARDS
from rlft.rewards.math import (HEDGE, boxed_contents, check_answer, extract_answer, fast_compare, gold_answer,
                               plain_number, verifier_pool)

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def reward():
    fn = BUILTIN_REWARDS["math"](timeout=TIMEOUT)
    fn("q", r"\boxed{x+1}", answer="1+x")  # start the workers once for the module
    return fn


def test_boxed_contents_balances_braces():
    assert boxed_contents(r"a \boxed{\frac{1}{2}} b \boxed {x^{2}}") == [r"\frac{1}{2}", "x^{2}"]
    assert boxed_contents(r"\boxed{1 + \boxed{2}") == ["2"]  # the outer box never closes
    assert boxed_contents(r"\boxed{\boxed{2}}") == [r"\boxed{2}"]  # outermost only: no false hedge
    assert boxed_contents(r"\boxed{}") == [""]


@pytest.mark.parametrize("completion, answer", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"first \boxed{3}, checking: \boxed{ 3 }", "3"),  # the same answer twice is not a hedge
    (r"\boxed{3} or \boxed{5}", HEDGE),
    ("The final answer is 42.", "42"),
    ("the answer is $-7$. Hope this helps", "-7"),
    ("**Answer:** 3.5", "3.5"),
    ("we add 3 and 4 to get 7", "7"),
    ("total 1,234 apples", "1,234"),
    ("no numbers here", None),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_gold_answer():
    assert gold_answer("Janet has ... #### 42") == "42"
    assert gold_answer(r"$\boxed{5}$") == "5"
    assert gold_answer(7) == "7"
    assert gold_answer(None) is None and gold_answer("  ") is None and gold_answer(True) is None


def test_plain_numbers_and_fast_path():
    assert plain_number("-1,000") == (Fraction(-1000), False)
    assert plain_number("0.50") == (Fraction(1, 2), True)
    assert plain_number(r"\frac{3}{4}") == (Fraction(3, 4), False)
    assert plain_number(r"\dfrac13") == (Fraction(1, 3), False)
    assert plain_number("1/0") is None and plain_number("x") is None and plain_number("1, 2") is None
    assert fast_compare("0.5", r"\frac{1}{2}") is True
    assert fast_compare("100000000", "100000001") is False  # exact rationals: exact comparison
    assert fast_compare("0.333", r"\frac13") is False  # 3.3e-4 apart: never equal at 6 decimals
    assert fast_compare("0.333333", r"\frac13") is None  # within 1e-6: math-verify's rounding decides
    assert fast_compare("2", "x") is None


@pytest.mark.parametrize("completion, gold, expected", [
    # known false positives that must stay false
    (r"\boxed{\pm 2021}", "2021", 0.0),
    (r"\boxed{1, 2}", "1, 2, 3", 0.0),  # a subset of a "find all" answer
    (r"\boxed{3} or \boxed{5}", "3", 0.0),  # hedging
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{0.333}", r"\frac13", 0.0),
    # true cases
    (r"\boxed{\frac13}", "0.333333", 1.0),  # math-verify: floats compared at 6 decimals
    (r"\boxed{\text{13}}", "13", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
    ("The final answer is 42", "42", 1.0),
    (r"\boxed{x^2 + 1}", "1+x^2", 1.0),
    (r"\boxed{\{3, 1, 2\}}", "1, 2, 3", 1.0),
    (r"\boxed{\sqrt 2}", r"\sqrt{2}", 1.0),
    ("so the answer is 7", "#### 7", 1.0),
    ("so the answer is 8", "7", 0.0),
])
def test_golden_cases(reward, completion, gold, expected):
    assert reward("q", completion, answer=gold) == expected


def test_missing_or_unparseable_gold_is_unverifiable(reward):
    assert reward("q", r"\boxed{5}", answer=None) is None
    assert reward("q", r"\boxed{5}") is None
    assert reward("q", r"\boxed{5}", answer=r"\frac{") is None
    other = BUILTIN_REWARDS["math"](field="solution")
    assert other("q", r"\boxed{5}", solution="5") == 1.0


def test_64_concurrent_calls_from_threads(reward):
    cases = [(rf"\boxed{{{i}x + {i}}}", f"{i}*(x+1)", 1.0) for i in range(1, 17)]  # needs sympy
    cases += [(rf"\boxed{{{i}x + {i}}}", f"{i}*(x+2)", 0.0) for i in range(1, 17)]
    cases += [(f"answer: {i}", str(i), 1.0) for i in range(16)]  # fast path
    cases += [(rf"\boxed{{\frac{{{i}}}{{{i + 1}}}}}", f"{i + 1}/{i}", 0.0) for i in range(1, 17)]
    assert len(cases) == 64
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda c: reward("q", c[0], answer=c[1]), cases))
    assert got == [c[2] for c in cases]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("answer", [r"9^{9^{9^{9}}}", "garbage"])
def test_hostile_answers_return_in_time_and_leave_no_stuck_worker(reward, answer, monkeypatch):
    if answer == "garbage":  # 100 KB of noise, not a plain number, checked without the length cap
        rng = random.Random(0)
        answer = "x^{" + "".join(rng.choice(string.printable) for _ in range(100_000))
    pool = verifier_pool(2)
    before = set(pool.worker_pids())
    replies = []
    check = pool.check

    def counted(*args, **kwargs):
        replies.append(check(*args, **kwargs))
        return replies[-1]

    monkeypatch.setattr(pool, "check", counted)
    start = time.monotonic()
    result = check_answer("5", answer, timeout=TIMEOUT, max_answer_chars=10**6)
    elapsed = time.monotonic() - start
    assert result == 0.0
    # one worker call, which either answered or hit its deadline (then its worker was killed)
    assert len(replies) == 1
    assert "why" not in replies[0] or replies[0]["why"] == f"math-verify took longer than {TIMEOUT}s"
    if "why" in replies[0]:
        assert before - set(pool.worker_pids())
    # Generous on purpose (a shared 2-core machine can stall a process for seconds): what this
    # guards is "bounded at all"; a call that waited on the stuck worker would take minutes
    assert elapsed < TIMEOUT + 30.0
    replaced = before - set(pool.worker_pids())
    for pid in replaced:  # a worker that overran was killed, not left running
        assert not _alive(pid)
    deadline = time.monotonic() + 60
    while len(pool.worker_pids()) < 2 or pool._idle.qsize() < 2:  # replacements come up
        assert time.monotonic() < deadline, "no replacement worker started"
        time.sleep(0.1)
    assert all(_alive(pid) for pid in pool.worker_pids())
    assert reward("q", r"\boxed{2x}", answer="x+x") == 1.0  # and the pool still answers


def test_long_answers_are_not_parsed(reward, monkeypatch):
    """Counted, not timed: no worker is asked to parse an answer over the length cap."""
    from rlft.rewards.math import VerifierPool

    calls = []
    monkeypatch.setattr(VerifierPool, "check", lambda self, *a, **k: calls.append(a) or {"verdict": True})
    assert reward("q", r"\boxed{" + "1+" * 5000 + "1}", answer="5001") == 0.0
    assert calls == []
    assert reward("q", r"\boxed{x+x}", answer="2x") == 1.0 and len(calls) == 1  # the spy does see calls


def test_the_calling_process_never_imports_the_parser():
    """Parsing model text can hang or blow up; it only ever happens in the workers."""
    code = ("import sys\nfrom rlft.rewards.scoring import BUILTIN_REWARDS\n"
            "f = BUILTIN_REWARDS['math'](workers=1)\n"
            "assert f('q', r'\\boxed{x+1}', answer='1+x') == 1.0\n"
            "print('math_verify' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]
