"""Parent-side pieces of the code reward: test formats, comparison, grading, code extraction,
and the pure helpers of the isolation module. No sandbox is started here."""

import json
import struct

import pytest

from rlft.rewards.code.cases import (BadTests, Credit, grade, judge_case, normalise_stdout, parse_tests,
                                     values_equal)
from rlft.rewards.code.isolation import blocked_ancestor, is_under, seccomp_filter_bytes, sweep_uid
from rlft.rewards.code.reward import extract_code

STDIO = {"cases": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "2 2", "stdout": "4"}]}
CALL = {"fn_name": "solve", "cases": [{"input": [2], "output": 4}, {"input": [3], "output": 9}]}


def test_parse_tests_accepts_both_formats_as_dict_or_json_string():
    call = parse_tests(json.dumps(CALL))
    assert call.mode == "call" and call.fn_name == "solve"
    assert call.child_cases() == [{"args": [2]}, {"args": [3]}]  # inputs only: no expected outputs
    stdio = parse_tests(STDIO)
    assert stdio.mode == "stdio"
    assert stdio.child_cases() == [{"stdin": "1 2\n"}, {"stdin": "2 2"}]
    assert "3" not in json.dumps(stdio.child_cases())


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
    ({"cases": []}, "non-empty"),
    ({"fn_name": "solve", "cases": [{"input": 2, "output": 4}]}, "list of positional arguments"),
    ({"fn_name": "so lve", "cases": [{"input": [2], "output": 4}]}, "identifier"),
    ({"cases": [{"stdin": "1"}]}, "needs 'stdin' and 'stdout'"),
    ({"cases": [{"stdin": 1, "stdout": "1"}]}, "must be a string"),
])
def test_malformed_tests_raise_bad_tests_with_a_reason(bad, words):
    with pytest.raises(BadTests, match=words):
        parse_tests(bad)


def test_values_equal_is_structural_and_strict_about_types():
    assert values_equal([1, [2.0000001, "a"]], [1, [2.0, "a"]])  # floats: rel 1e-6
    assert not values_equal(2.001, 2.0)
    assert not values_equal(True, 1) and not values_equal(1, True)
    assert not values_equal("4", 4)
    assert not values_equal([1, 2], [1, 2, 3])
    assert values_equal({"a": [1]}, {"a": [1]}) and not values_equal({"a": 1}, {"b": 1})
    assert values_equal(None, None) and not values_equal(None, 0)


def test_stdout_normalisation_strips_trailing_space_per_line_only():
    assert normalise_stdout("1 2  \r\n3\n\n\n") == ["1 2", "3"]
    assert normalise_stdout("  1") == ["  1"]  # leading space is content
    assert normalise_stdout("") == []


def _report(**kw):
    base = {"status": "exited", "time": 0.01, "stdout": "", "stderr": "", "result": None,
            "exit_code": 0, "signal": None}
    return {**base, **kw}


def test_judge_case_stdio():
    suite = parse_tests(STDIO)
    assert judge_case(suite, 0, _report(stdout="3   \n"))[0].status == "passed"
    result, ran = judge_case(suite, 0, _report(stdout="3\n4\n"))
    assert (result.status, ran) == ("wrong_answer", True) and "expected 1 lines, got 2" in result.detail
    # exit code 0 alone is never a pass, and printing nothing did not really run
    result, ran = judge_case(suite, 0, _report(stdout=""))
    assert (result.status, ran) == ("wrong_answer", False)
    result, _ = judge_case(suite, 0, _report(stdout="3\n", exit_code=1, stderr="Traceback\nValueError: x\n"))
    assert result.status == "runtime_error" and "ValueError: x" in result.detail
    assert judge_case(suite, 0, _report(signal=24))[0].status == "timeout"  # SIGXCPU: CPU limit
    assert judge_case(suite, 0, _report(status="output_limit"))[0].status == "output_limit"


def test_judge_case_call_reads_only_a_json_value():
    suite = parse_tests(CALL)
    assert judge_case(suite, 0, _report(result='{"value": 4}'))[0].status == "passed"
    assert judge_case(suite, 0, _report(result='{"value": 5}'))[0].status == "wrong_answer"
    # what the program prints means nothing in call mode
    assert judge_case(suite, 0, _report(stdout="4\nPASSED\n"))[0].status == "runtime_error"
    assert judge_case(suite, 0, _report(result="garbage"))[0].status == "runtime_error"


def test_grade_hand_computed():
    suite = parse_tests({"cases": [{"stdin": "", "stdout": str(i)} for i in range(4)]})
    reports = [_report(stdout="0"), _report(stdout="1"), _report(stdout="9"), _report(status="timeout")]
    verdict = grade(suite, reports, Credit(), {})
    # parse 0.2 + run 0.4 × 3/4 (three ran cleanly) + tests 0.4 × 2/4 = 0.2 + 0.3 + 0.2 = 0.7
    assert verdict.parts == pytest.approx({"parse": 0.2, "run": 0.3, "tests": 0.2})
    assert verdict.score == pytest.approx(0.7)
    assert (verdict.status, verdict.passed, verdict.total) == ("wrong_answer", 2, 4)
    assert [c.passed for c in verdict.cases] == [True, True, False, False]
    custom = grade(suite, reports, Credit(parse=0.0, run=0.0, tests=1.0), {})
    assert custom.score == pytest.approx(0.5)


def test_running_cleanly_earns_nothing_without_a_passing_test():
    # every case runs and prints a wrong answer: parse 0.2 only (run credit needs >= 1 pass; it
    # used to be 0.2 + 0.4 = 0.6 for a program that solves nothing)
    suite = parse_tests({"cases": [{"stdin": "", "stdout": str(i)} for i in range(3)]})
    verdict = grade(suite, [_report(stdout="7")] * 3, Credit(), {})
    assert verdict.parts == pytest.approx({"parse": 0.2, "run": 0.0, "tests": 0.0})
    assert verdict.score == pytest.approx(0.2) and verdict.status == "wrong_answer"
    # one pass brings the run credit back in full: 0.2 + 0.4 x 3/3 + 0.4 x 1/3
    verdict = grade(suite, [_report(stdout="0")] + [_report(stdout="7")] * 2, Credit(), {})
    assert verdict.score == pytest.approx(0.2 + 0.4 + 0.4 / 3)


def test_extract_code_prefers_the_last_block_in_the_language():
    text = "```python\nprint(1)\n```\ntext\n```js\nconsole.log(2)\n```\n```py\nprint(3)\n```\n```\nplain\n```"
    assert extract_code(text) == "print(3)\n"
    assert extract_code("```js\nx()\n```\n```\nprint(4)\n```") == "print(4)\n"  # last fence of any kind
    assert extract_code("no fence here: print(1)") is None
    assert extract_code("print(1)", allow_unfenced=True) == "print(1)"
    # a fence cut off by the length limit is not code
    assert extract_code("```python\nprint(1)\n```\n```python\nprint(2") == "print(1)\n"
    assert extract_code("```python\nprint(2") is None


def test_seccomp_program_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        code = seccomp_filter_bytes(machine)
        assert len(code) % 8 == 0
        instructions = [struct.unpack("HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
        # every jump lands inside the program; the last three are the return instructions
        for i, (op, jt, jf, _) in enumerate(instructions):
            if op & 0x07 == 0x05:
                assert i + 1 + max(jt, jf) < len(instructions)
        assert [op for op, *_ in instructions[-3:]] == [0x06, 0x06, 0x06]
    with pytest.raises(OSError):
        seccomp_filter_bytes("sparc")


def test_path_helpers(tmp_path):
    hidden = tmp_path / "hidden"
    (hidden / "inner").mkdir(parents=True)
    hidden.chmod(0o700)
    assert blocked_ancestor(str(hidden / "inner")) is not None
    assert blocked_ancestor("/usr/lib") is None
    assert is_under("/a/b/c", ["/a/b"]) and not is_under("/a/bc", ["/a/b"]) and is_under("/a", ["/a"])
    with pytest.raises(ValueError):
        sweep_uid(0)
