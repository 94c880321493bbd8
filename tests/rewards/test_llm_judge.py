"""The `llm_judge` reward against a stub OpenAI-compatible server on 127.0.0.1 (tests/judge_stub.py):
the three reply forms, what the judge is sent, retries, time limits, refused connections, the
concurrency bound, and the errors a wrong setup gets."""

from __future__ import annotations

import time

import pytest

from judge_stub import MODEL, NAP_S, RUBRIC, JudgeStub, closed_port_url
from rlft.config import RewardSpec
from rlft.errors import ConfigError, RewardError
from rlft.rewards import RewardScorer
from rlft.rewards.judge_replies import parse_score


@pytest.fixture(scope="module")
def stub():
    server = JudgeStub()
    yield server
    server.close()


def scorer(base_url: str, scoring_timeout_s: float = 60.0, **args) -> RewardScorer:
    spec = RewardSpec(fn="llm_judge", name="judge",
                      args={"base_url": base_url, "model": MODEL, "rubric": RUBRIC, "backoff_s": 0.01, **args})
    return RewardScorer([spec], timeout_s=scoring_timeout_s, warn=None)


def score(s: RewardScorer, completions: list[str], rows: list[dict] | None = None):
    rows = rows or [{} for _ in completions]
    return s.score(["What is good?"] * len(completions), completions, rows)


def test_number_verdict_word_json_and_garbage(stub):
    s = scorer(stub.base_url)
    out = score(s, ["good good good", "word Correct", "word incorrect", "json 6", "garbage"])
    # 3 "good"s -> "Score: 3" on 0..10 -> 0.3; "Correct." -> 1.0; "incorrect." -> 0.0; {"score": 6} -> 0.6
    assert out.total == [pytest.approx(0.3), 1.0, 0.0, pytest.approx(0.6), None]
    assert out.info["judge/reply"][0] == "It says good 3 times.\nScore: 3"
    assert out.info["judge/reply"][4] == "I would rather not say."  # the unreadable reply is kept
    assert out.info["judge/raw"] == [3.0, 1.0, 0.0, 6.0, None]
    m = out.metrics()
    # one unreadable of five: counted as unverifiable, and as the judge's own unparsable share
    assert m["reward/unverifiable_frac"] == pytest.approx(0.2) and m["reward/judge/unparsable"] == pytest.approx(0.2)
    assert m["reward/judge/failed"] == 0.0 and m["reward/mean"] == pytest.approx((0.3 + 1 + 0 + 0.6) / 4)
    _, lines = s.take_report()
    assert len(lines) == 1 and "1 of 5 judge replies had no readable verdict" in lines[0]
    assert "'I would rather not say.'" in lines[0]
    assert s.take_report()[1] == []  # reported once


def test_the_judge_is_sent_rubric_conversation_answer_and_reference(stub, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    s = scorer(stub.base_url, reference_field="answer", system="You grade answers.", max_tokens=64,
               api_key_env="JUDGE_KEY")
    assert s.required_fields == ("answer",)  # checked on every prompt row before training
    before = len(stub.requests)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say good."}]
    out = score(s, ["good"], [{"answer": "good", "messages": conversation}])
    assert out.total == [pytest.approx(0.1)]
    [request] = stub.requests[before:]
    body = request["body"]
    assert body["model"] == MODEL and body["temperature"] == 0.0 and body["max_tokens"] == 64
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    system, user = body["messages"]
    assert system == {"role": "system", "content": "You grade answers."}
    text = user["content"]
    assert text.startswith(RUBRIC)
    # the whole conversation, then the answer, then the reference, then the reply form, in order
    order = ["### system\nBe brief.\n### user\nSay good.", "## Answer to grade\ngood", "## Reference answer\ngood",
             'End your reply with the line "Score: N", where N is a number from 0 to 10.']
    positions = [text.index(part) for part in order]
    assert positions == sorted(positions)


def test_http_500_and_429_are_retried(stub):
    s = scorer(stub.base_url)
    out = score(s, ["flaky good good good good good good good good good", "busy good good good good"])
    assert out.total == [pytest.approx(0.9), pytest.approx(0.4)]
    assert out.info["judge/attempts"] == [2, 2]  # one failure each, then the answer
    assert out.metrics()["reward/judge/attempts"] == 2.0
    assert s.take_report()[1] == []  # a retried request that succeeded is no failure


def test_a_slow_reply_times_out_and_is_counted(stub):
    s = scorer(stub.base_url, scoring_timeout_s=5, timeout_s=0.3, max_retries=0)
    start = time.monotonic()
    out = score(s, ["slow good", "good"])
    assert time.monotonic() - start < 1.2  # the stub answers after 1.5 s; the judge stopped waiting at 0.3 s
    assert out.total == [None, pytest.approx(0.1)]
    assert out.info["judge/failed"] == [1.0, 0.0] and out.info["judge/reply"] == [None, out.info["judge/reply"][1]]
    assert "within 0.3s" in out.info["judge/error"][0]
    _, lines = s.take_report()
    assert "1 of 2 judge requests failed" in lines[0] and "within 0.3s" in lines[0]


def test_connection_refused_is_unverifiable_and_counted():
    s = scorer(closed_port_url(), max_retries=2)
    out = score(s, ["good", "good good"])
    assert out.total == [None, None]
    assert out.info["judge/attempts"] == [3, 3]  # the first try and two retries
    assert "connection refused" in out.info["judge/error"][0]
    assert out.metrics()["reward/unverifiable_frac"] == 1.0 and out.metrics()["reward/judge/failed"] == 1.0
    assert "2 of 2 judge requests failed" in s.take_report()[1][0]


def test_a_reply_that_is_not_a_chat_completion_is_not_retried(stub):
    before = len(stub.requests)
    out = score(scorer(stub.base_url), ["badjson"])
    assert out.total == [None] and "not a chat completion" in out.info["judge/error"][0]
    assert len(stub.requests) - before == 1


def test_at_most_max_concurrency_requests_in_flight():
    own = JudgeStub()  # no request of another test still in flight
    try:
        s = scorer(own.base_url, max_concurrency=2)
        start = time.monotonic()
        out = score(s, [f"nap {'good ' * i}".strip() for i in range(6)])
        assert out.total == [pytest.approx(i / 10) for i in range(6)]
        assert own.peak == 2
        assert time.monotonic() - start >= 3 * NAP_S * 0.9  # six naps, two at a time
    finally:
        own.close()


def test_unknown_model_stops_with_the_fix(stub):
    s = scorer(stub.base_url, model="no-such-model")
    with pytest.raises(RewardError) as err:
        score(s, ["good"])
    text = str(err.value)
    assert "HTTP 404" in text and "args.model" in text and "does not exist" in text


@pytest.mark.parametrize("args, message", [
    ({"base_url": "localhost:8000"}, "args.base_url"),
    ({"reply_format": "xml"}, "args.reply_format"),
    ({"score_range": [10, 0]}, "args.score_range"),
    ({"max_concurrency": 0}, "args.max_concurrency"),
    ({"timeout_s": 0}, "args.timeout_s"),
    ({"rubric": "  "}, "args.rubric"),
    ({"api_key_env": "RLFT_NO_SUCH_VARIABLE"}, "not set"),
    ({"temprature": 0.5}, "temprature"),
    ({"verdicts": {"very good": 1}}, "args.verdicts"),
    ({"verdicts": {"good": "high"}}, "args.verdicts"),
])
def test_bad_args_are_one_config_error(args, message):
    spec = {"base_url": "http://127.0.0.1:1/v1", "model": MODEL, "rubric": RUBRIC, **args}
    with pytest.raises(ConfigError, match=message):
        RewardScorer([RewardSpec(fn="llm_judge", args=spec)])


def test_the_time_limit_must_cover_the_judges_retries():
    args = {"base_url": "http://127.0.0.1:1/v1", "model": MODEL, "rubric": RUBRIC}
    RewardScorer([RewardSpec(fn="llm_judge", args=args)], timeout_s=51)  # defaults: 3 x 15 s + 2 + 4 s = 51 s
    args.update(timeout_s=30, max_retries=3, backoff_s=1)  # 4 attempts x 30 s + back-off 1 + 2 + 4 s = 127 s
    with pytest.raises(ConfigError, match=r"(?s)scoring.timeout_s=60 .* 127s .*scoring.timeout_s=127 or more"):
        RewardScorer([RewardSpec(fn="llm_judge", args=args)], timeout_s=60)
    RewardScorer([RewardSpec(fn="llm_judge", args=args)], timeout_s=127)


def test_parse_score_reads_verdicts_and_refuses_other_scales():
    verdicts = {"pass": 1.0, "fail": -1.0}
    assert parse_score("Verdict: PASS", 1, 5, verdicts) == (1.0, 1.0)
    assert parse_score("**Fail**", 1, 5, verdicts) == (-1.0, -1.0)
    assert parse_score("Rating: 4/5", 1, 5, verdicts) == (0.75, 4.0)  # (4 - 1) / (5 - 1)
    assert parse_score("Rating: 4/10", 1, 5, verdicts) is None  # another scale than asked
    assert parse_score("The format is Score: N.\nScore: 2", 1, 5, verdicts) == (0.25, 2.0)  # the last one
