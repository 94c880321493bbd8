"""The sloppy annotator's tool-use transcripts for the word-problem demo: deterministic by seed,
the configured share of calls and of right guesses, results that are the calculator's own, wrong
guesses that are wrong, and every trace valid SFT data with the calculator."""

from __future__ import annotations

import re

import pytest

from rlft.demo import tool_traces as tt
from rlft.demo import word_problems as wp


@pytest.fixture(scope="module")
def rows():
    return wp.make_splits(seed=0, train_rows=1000, heldout_rows=10)["train"]


def test_same_seed_same_traces_and_the_shares_match_the_annotator(rows):
    traces = tt.sloppy_traces(rows, seed=1, annotator=tt.Annotator(call_rate=0.3, guess_accuracy=0.6))
    assert traces == tt.sloppy_traces(rows, seed=1, annotator=tt.Annotator(call_rate=0.3, guess_accuracy=0.6))
    assert traces != tt.sloppy_traces(rows, seed=2, annotator=tt.Annotator(call_rate=0.3, guess_accuracy=0.6))
    kinds = [t["trace"] for t in traces]
    calls = kinds.count("call") / len(kinds)
    # binomial, n = 1000, p = 0.3: sd = 0.0145, so +-0.05 is 3.4 sd; guesses: n ~ 700, p = 0.6, sd = 0.0185
    assert abs(calls - 0.3) < 0.05
    guesses = [k for k in kinds if k != "call"]
    assert abs(guesses.count("guess_right") / len(guesses) - 0.6) < 0.065
    assert {t["trace"] for t in tt.sloppy_traces(rows[:50], annotator=tt.Annotator(call_rate=1.0))} == {"call"}
    with pytest.raises(ValueError, match="call_rate"):
        tt.Annotator(call_rate=1.5)


def test_calls_carry_the_calculators_result_and_guesses_are_right_or_wrong_as_labelled(rows):
    from rlft.rewards.math import math_reward

    score = math_reward()
    for t in tt.sloppy_traces(rows[:300], seed=3):
        system, user, *turns = t["messages"]
        assert system == {"role": "system", "content": tt.TOOL_SYSTEM_PROMPT} and user["role"] == "user"
        a, op, b, answer = t["a"], t["op"], t["b"], int(t["answer"])
        final = turns[-1]["content"]
        if t["trace"] == "call":
            [call] = turns[0]["tool_calls"]
            assert call["function"] == {"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}}
            assert turns[1] == {"role": "tool", "name": "calculator", "content": str(answer)}
        else:
            assert len(turns) == 1
        value = int(re.fullmatch(r".* = (\d+)\. The answer is (\d+)\.", final).group(2))
        assert re.fullmatch(wp.FORMAT_REGEX, final)
        assert (value == answer) == (t["trace"] != "guess_wrong"), t
        assert score(user["content"], final, answer=t["answer"]) == (0.0 if t["trace"] == "guess_wrong" else 1.0)


def test_the_annotators_style_lead_ins_and_answer_forms(rows):
    style = tt.Annotator(call_rate=0.5, guess_accuracy=0.0, lead_ins=("",), answer="{expression} = {value}",
                         answer_after_call="{value}")
    traces = tt.sloppy_traces(rows[:60], seed=5, annotator=style)
    assert {t["trace"] for t in traces} == {"call", "guess_wrong"}  # guess_accuracy 0: every guess a slip
    for t in traces:
        final = t["messages"][-1]["content"]
        if t["trace"] == "call":
            assert t["messages"][2]["content"] == "" and final == t["answer"]  # no lead-in; the result alone
        else:
            assert final.startswith(f"{t['a']} {t['op']} {t['b']} = ") and not final.endswith(f"= {t['answer']}")


def test_slips_are_plausible_and_never_right():
    rng = tt.random.Random(0)
    assert {tt.slip(rng, "+", 47, 38, 85) for _ in range(200)} == {95, 75, 86, 84}  # carry +-10, off by one
    assert {tt.slip(rng, "*", 12, 9, 108) for _ in range(200)} == {118, 98, 109, 107, 120, 96}  # one group of 12
    assert {tt.slip(rng, "-", 12, 9, 3) for _ in range(100)} == {13, 4, 2}  # 3 - 10 would be negative


def test_every_trace_is_valid_sft_data_with_the_calculator(rows, qwen_path):
    from rlft.config import ModelConfig
    from rlft.data.readers import Row
    from rlft.data.sft_examples import make_sft_encoder
    from rlft.data.tool_transcripts import TranscriptEncoder
    from rlft.data.validate import check_rows
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import end_of_turn_ids
    from rlft.rollout.agent.tool_calls import hermes, write_hermes
    from rlft.rollout.agent.tools import load_tools

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    encoder = TranscriptEncoder(tok, load_tools(["calculator"]), hermes, write_hermes, 256)
    traces = tt.sloppy_traces(rows[:40], seed=4, annotator=tt.Annotator(call_rate=0.5))
    examples = check_rows([Row(f"traces.jsonl:{i + 1}", t) for i, t in enumerate(traces)],
                          make_sft_encoder(tok, end_of_turn_ids(tok), 4000, transcripts=encoder), "traces.jsonl", "SFT")
    assert len(examples) == 40
    called = [e for e, t in zip(examples, traces) if t["trace"] == "call"]
    assert called and all("<tool_call>" in tok.decode([i for i, m in zip(e.input_ids, e.target_mask) if m])
                          for e in called)
