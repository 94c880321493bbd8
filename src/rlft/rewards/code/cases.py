"""Test formats, output comparison and grading for the code reward. Parent side only.

Two formats, as in public code datasets (a dict, or the same as a JSON string):

    call-based   {"fn_name": "solve", "cases": [{"input": [2], "output": 4}, ...]}
                 `input` is the list of positional arguments; the return value must equal
                 `output` (JSON types; floats within rel 1e-6 / abs 1e-9).
    stdio-based  {"cases": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}
                 stdout is compared line by line after stripping trailing whitespace per line
                 and trailing blank lines; the line count must match.

The child only ever sees `child_cases()` (inputs); expected outputs stay in this process.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


class BadTests(ValueError):
    """The test data itself is malformed: an infrastructure problem, not a wrong answer."""


@dataclass(frozen=True)
class Suite:
    mode: str  # "call" | "stdio"
    cases: list[dict[str, Any]]  # call: {"args", "expected"}; stdio: {"stdin", "expected"}
    fn_name: str | None = None

    def child_cases(self) -> list[dict[str, Any]]:
        """What the sandbox receives: inputs only."""
        if self.mode == "call":
            return [{"args": c["args"]} for c in self.cases]
        return [{"stdin": c["stdin"]} for c in self.cases]


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise BadTests(f"{where} must be a string (or a list of lines), got {type(value).__name__}")


def parse_tests(tests: Any) -> Suite:
    """Validate a row's tests; raises BadTests with a message naming the problem."""
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as exc:
            raise BadTests(f"tests are not valid JSON: {exc}") from None
    if not isinstance(tests, dict):
        raise BadTests(f"tests must be a JSON object with 'cases', got {type(tests).__name__}")
    cases = tests.get("cases")
    if not isinstance(cases, list) or not cases:
        raise BadTests("tests need a non-empty list 'cases'")
    fn_name = tests.get("fn_name")
    if fn_name is not None:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise BadTests(f"fn_name must be a Python identifier, got {fn_name!r}")
        out = []
        for i, case in enumerate(cases):
            if not isinstance(case, dict) or "input" not in case or "output" not in case:
                raise BadTests(f"case {i}: a call-based case needs 'input' (argument list) and 'output'")
            if not isinstance(case["input"], list):
                raise BadTests(f"case {i}: 'input' must be the list of positional arguments")
            out.append({"args": case["input"], "expected": case["output"]})
        return Suite("call", out, fn_name)
    out = []
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or "stdin" not in case or "stdout" not in case:
            raise BadTests(f"case {i}: a stdio case needs 'stdin' and 'stdout' (or give 'fn_name' for call-based tests)")
        out.append({"stdin": _text(case["stdin"], f"case {i} stdin"),
                    "expected": _text(case["stdout"], f"case {i} stdout")})
    return Suite("stdio", out)


def normalise_stdout(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def values_equal(got: Any, expected: Any) -> bool:
    """Structural equality on JSON values; bool is not a number here (True != 1)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


@dataclass(frozen=True)
class Credit:
    """Graded credit: parses, runs, tests × pass ratio. `run` is scaled by the fraction of cases
    that ran cleanly, so it is the full 0.4 when every case runs and still gives a gradient when
    some crash -- but only once at least one test passes: a program that runs cleanly and passes
    nothing (prints a constant, returns None) would otherwise earn 0.6, a standing invitation to
    reward hacking on weak test sets."""

    parse: float = 0.2
    run: float = 0.4
    tests: float = 0.4


@dataclass
class CaseResult:
    index: int
    status: str  # passed | wrong_answer | runtime_error | timeout | output_limit | not_run
    time_s: float = 0.0
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Verdict:
    """What the parent decided about one program. `score` is None when it could not be verified
    (status infra_error or bad_tests)."""

    status: str  # ok | no_code | syntax_error | runtime_error | timeout | wrong_answer | output_limit | infra_error | bad_tests
    score: float | None
    passed: int = 0
    total: int = 0
    cases: list[CaseResult] = field(default_factory=list)
    parts: dict[str, float] | None = None
    layers: dict[str, bool | str] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for case, raw in zip(self.cases, out["cases"]):
            raw["passed"] = case.passed
        return out


def unverifiable(status: str, message: str, total: int = 0, layers: dict | None = None) -> Verdict:
    return Verdict(status, None, 0, total, [], None, layers or {}, message)


def zero(status: str, message: str, credit: Credit, total: int = 0, layers: dict | None = None,
         parsed: bool = False) -> Verdict:
    parts = {"parse": credit.parse if parsed else 0.0, "run": 0.0, "tests": 0.0}
    return Verdict(status, sum(parts.values()), 0, total, [], parts, layers or {}, message)


def _short(text: str, n: int = 120) -> str:
    text = repr(text) if not isinstance(text, str) else text
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


def _last_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def judge_case(suite: Suite, index: int, report: dict[str, Any]) -> tuple[CaseResult, bool]:
    """(result, ran_cleanly) for one case, from the sandbox's report of what the program did."""
    expected = suite.cases[index]["expected"]
    status, t = report.get("status"), float(report.get("time", 0.0))
    if status == "not_run":
        return CaseResult(index, "not_run", 0.0, "time budget used up by earlier cases"), False
    if status in ("timeout", "output_limit"):
        return CaseResult(index, status, t, ""), False
    sig = report.get("signal")
    if sig is not None:
        # RLIMIT_CPU ends a process with SIGXCPU (24) then SIGKILL: a CPU-time timeout.
        name = "timeout" if sig == 24 else "runtime_error"
        return CaseResult(index, name, t, f"killed by signal {sig}; {_last_line(report.get('stderr', ''))}"), False
    if suite.mode == "call":
        try:
            payload = json.loads(report.get("result") or "")
            got = payload["value"]
        except (ValueError, KeyError, TypeError):
            detail = _last_line(report.get("stderr", "")) or "the function returned no result"
            return CaseResult(index, "runtime_error", t, detail), False
        ok = values_equal(got, expected)
        detail = "" if ok else f"expected {_short(json.dumps(expected))}, got {_short(json.dumps(got))}"
        return CaseResult(index, "passed" if ok else "wrong_answer", t, detail), True
    if report.get("exit_code") != 0:
        return CaseResult(index, "runtime_error", t,
                          f"exit code {report.get('exit_code')}; {_last_line(report.get('stderr', ''))}"), False
    got_lines, want_lines = normalise_stdout(report.get("stdout", "")), normalise_stdout(expected)
    ran = bool(got_lines) or not want_lines  # a program that prints nothing did not really run
    if got_lines == want_lines:
        return CaseResult(index, "passed", t), ran
    if len(got_lines) != len(want_lines):
        detail = f"expected {len(want_lines)} lines, got {len(got_lines)}"
    else:
        k = next(i for i, (g, w) in enumerate(zip(got_lines, want_lines)) if g != w)
        detail = f"line {k + 1}: expected {_short(want_lines[k])}, got {_short(got_lines[k])}"
    return CaseResult(index, "wrong_answer", t, detail), ran


def grade(suite: Suite, reports: list[dict[str, Any]], credit: Credit, layers: dict) -> Verdict:
    """Turn per-case reports into a verdict. The caller has checked len(reports) == len(cases)."""
    results, ran = [], 0
    for i, report in enumerate(reports):
        result, clean = judge_case(suite, i, report)
        results.append(result)
        ran += clean
    total = len(suite.cases)
    passed = sum(r.passed for r in results)
    run = credit.run * ran / total if passed else 0.0  # running counts only with a passing test (see Credit)
    parts = {"parse": credit.parse, "run": run, "tests": credit.tests * passed / total}
    failing = next((r for r in results if not r.passed), None)
    status = "ok" if failing is None else ("timeout" if failing.status == "not_run" else failing.status)
    message = "" if failing is None else f"case {failing.index}: {failing.status} {failing.detail}".strip()
    return Verdict(status, sum(parts.values()), passed, total, results, parts, layers, message)
