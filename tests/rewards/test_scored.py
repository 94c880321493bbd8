"""Rewards returning `Scored(value, info)`: notes are logged, never summed; the scorer's
`reward/disagreement` in the total's units; `Scores` split and joined with its notes."""

from __future__ import annotations

import pytest

from rlft.config import RewardSpec
from rlft.errors import RewardError
from rlft.rewards import RewardScorer, Scored, Scores

USER = '''
from rlft.rewards import Scored

def spread(prompt, completion, **row):
    """value = len(completion), disagreement = number of spaces, a text note."""
    return Scored(float(len(completion)), {"disagreement": float(completion.count(" ")), "why": "length"})

def unsure(prompt, completion, **row):
    """value 1, disagreement 0.5 except for "x", where it cannot tell (no disagreement note)."""
    return Scored(None, {"why": "x"}) if completion == "x" else Scored(1.0, {"disagreement": 0.5})

def bad_notes(prompt, completion, **row):
    return Scored(1.0, {"tokens": [1, 2]})
'''


@pytest.fixture
def user(tmp_path):
    path = tmp_path / "scored_rewards.py"
    path.write_text(USER)
    return path


def test_notes_are_logged_and_disagreement_is_weighted_into_total_units(user):
    s = RewardScorer([RewardSpec(fn=f"{user}:spread", weight=2.0), RewardSpec(fn=f"{user}:unsure", weight=-1.0)],
                     warn=None)
    out = s.score(["p"] * 3, ["a b", "abcd", "x"], [{}, {}, {}])
    # totals: 2 * 3 - 1 * 1 = 5; 2 * 4 - 1 = 7; "x": unsure is None -> None
    assert out.total == [5.0, 7.0, None]
    assert out.info["spread/disagreement"] == [1.0, 0.0, 0.0] and out.info["spread/why"] == ["length"] * 3
    assert out.info["unsure/disagreement"] == [0.5, 0.5, None]
    # |2| * 1 + |-1| * 0.5 = 2.5; 2 * 0 + 0.5 = 0.5; "x" has no disagreement from unsure -> None
    assert out.info["disagreement"] == [2.5, 0.5, None]
    m = out.metrics()
    assert m["reward/disagreement"] == pytest.approx(1.5)  # (2.5 + 0.5) / 2
    assert m["reward/spread/disagreement"] == pytest.approx(1 / 3)
    assert "reward/spread/why" not in m  # text notes are for samples.jsonl only
    assert m["reward/spread"] == pytest.approx(8 / 3)  # lengths (3 + 4 + 1) / 3, as for any reward
    assert out.sample_info(2) == {"spread/disagreement": 0.0, "spread/why": "length", "unsure/why": "x"}


def test_notes_that_cannot_be_logged_are_a_reward_error(user):
    with pytest.raises(RewardError, match=r"notes cannot be logged: Scored.info\['tokens'\] is a list"):
        RewardScorer([RewardSpec(fn=f"{user}:bad_notes")], warn=None).score(["p"], ["c"], [{}])


def test_subset_and_concat_keep_notes_aligned_with_samples():
    a = Scores([1.0, None], {"r": [1.0, None]}, {"r/reply": ["one", "two"]})
    b = Scores([3.0], {"r": [3.0], "s": [0.5]}, {})
    joined = Scores.concat([a, b])
    assert joined.total == [1.0, None, 3.0]
    assert joined.components == {"r": [1.0, None, 3.0], "s": [None, None, 0.5]}  # b's key, absent from a
    assert joined.info == {"r/reply": ["one", "two", None]}
    picked = joined.subset([2, 0])
    assert picked.total == [3.0, 1.0] and picked.info == {"r/reply": [None, "one"]}
    assert picked.components["s"] == [0.5, None]


def test_a_bare_value_and_its_scored_form_score_alike(user, tmp_path):
    (tmp_path / "plain.py").write_text("def f(prompt, completion, **row):\n    return 0.25\n")
    (tmp_path / "wrapped.py").write_text("from rlft.rewards import Scored\n"
                                         "def f(prompt, completion, **row):\n    return Scored(0.25)\n")
    plain = RewardScorer([RewardSpec(fn=f"{tmp_path}/plain.py:f", name="r")]).score(["p"], ["c"], [{}])
    wrapped = RewardScorer([RewardSpec(fn=f"{tmp_path}/wrapped.py:f", name="r")]).score(["p"], ["c"], [{}])
    assert plain.total == wrapped.total == [0.25] and plain.metrics() == wrapped.metrics()
    assert isinstance(Scored(0.25).info, dict) and wrapped.info == {}
