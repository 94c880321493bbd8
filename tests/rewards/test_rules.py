"""The rule rewards: exact match, regex / format, JSON fields (their doctests run in `make test`
too; these add the edge cases)."""

from __future__ import annotations

import pytest

from rlft.rewards.rules import exact_match, extract_json, json_fields, regex


def test_exact_match_strips_and_compares_case_as_asked():
    assert exact_match()("q", " 42\n", answer="42") == 1.0
    assert exact_match()("q", "42.", answer="42") == 0.0
    assert exact_match(strip=False)("q", " 42", answer="42") == 0.0
    assert exact_match(case_sensitive=False)("q", "Paris", answer="PARIS") == 1.0
    assert exact_match(field="gold")("q", "7", gold=7) == 1.0  # the field is compared as text
    assert exact_match(field="gold").required_fields == ("gold",)


def test_regex_search_fullmatch_and_flags():
    fmt = r"The answer is \d+\."
    assert regex(fmt)("q", "Let me think. The answer is 12. Done") == 1.0
    assert regex(fmt, mode="fullmatch")("q", "Let me think. The answer is 12.") == 0.0
    assert regex(fmt, mode="fullmatch")("q", "  The answer is 12.\n") == 1.0  # surrounding space stripped
    assert regex("the answer", flags="i")("q", "THE ANSWER") == 1.0
    assert regex("^b$", flags="m")("q", "a\nb\nc") == 1.0 and regex("^b$")("q", "a\nb\nc") == 0.0
    with pytest.raises(ValueError, match="mode"):
        regex("x", mode="match")
    with pytest.raises(ValueError, match="unknown flag 'x'"):
        regex("x", flags="x")


def test_extract_json_prefers_a_fence_then_the_outer_object():
    assert extract_json('text ```json\n{"a": 1}\n``` more {"b": 2}') == {"a": 1}
    assert extract_json('Sure! {"a": {"b": [1, 2]}} hope that helps') == {"a": {"b": [1, 2]}}
    assert extract_json("no json here") is None
    assert extract_json("[1, 2]") == [1, 2]


def test_json_fields_graded_by_required_fields_and_values():
    reward = json_fields(required=["name", "age", "city"])
    # 2 of 3 required fields present -> 2/3
    assert reward("q", '{"name": "Ana", "age": 31}') == pytest.approx(2 / 3)
    assert reward("q", "not json") == 0.0
    assert reward("q", "[1, 2, 3]") == 0.0  # JSON, but not an object
    # per-row expected values: right name, wrong age -> 1/2 with check_values, 2/2 without
    checked = json_fields(field="expected", check_values=True)
    row = {"expected": {"name": "Ana", "age": 31}}
    assert checked("q", '{"name": "Ana", "age": 30}', **row) == 0.5
    assert json_fields(field="expected")("q", '{"name": "Ana", "age": 30}', **row) == 1.0
    assert json_fields()("q", "{}") == 1.0  # nothing required: any object passes
