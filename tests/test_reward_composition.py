"""Weighted composition of reward components, user functions from config, None handling, pass@k."""

from __future__ import annotations

import math
import sys

import pytest

from rlft.config import RewardSpec
from rlft.errors import ConfigError, RewardError
from rlft.eval.generation import pass_at_k
from rlft.rewards.scoring import RewardScorer

USER_MODULE = '''
def half(prompt, completion, **row):
    return 0.5

def parts(prompt, completion, **row):
    return {"a": 1.0, "b": 0.25}

def maybe(prompt, completion, answer=None, **row):
    return None if answer is None else float(completion == answer)

def scaled(prompt, completion, scale=1.0, **row):
    return scale
'''


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_MODULE)
    return path


def test_weighted_sum_and_per_component_values(user_file):
    scorer = RewardScorer([RewardSpec(fn=f"{user_file}:half", weight=2.0),
                           RewardSpec(fn=f"{user_file}:parts", weight=-1.0),
                           RewardSpec(fn="exact_match", weight=0.5)])
    scores = scorer.score(["p", "p"], ["x", "y"], [{"answer": "x"}, {"answer": "x"}])
    # sample 0: 2*0.5 + (-1)*(1.0+0.25) + 0.5*1 = 1 - 1.25 + 0.5 = 0.25; sample 1: 1 - 1.25 + 0 = -0.25
    assert scores.total == pytest.approx([0.25, -0.25])
    assert scores.components["half"] == [0.5, 0.5]
    assert scores.components["parts"] == [1.25, 1.25]
    assert scores.components["parts/a"] == [1.0, 1.0] and scores.components["parts/b"] == [0.25, 0.25]
    assert scores.components["exact_match"] == [1.0, 0.0]
    metrics = scores.metrics()
    assert metrics["reward/mean"] == pytest.approx(0.0)
    assert metrics["reward/parts/b"] == pytest.approx(0.25)


def test_none_makes_the_sample_unverifiable_and_is_counted(user_file):
    scorer = RewardScorer([RewardSpec(fn=f"{user_file}:maybe"), RewardSpec(fn=f"{user_file}:half", weight=1.0)])
    scores = scorer.score(["p"] * 3, ["x", "y", "x"], [{"answer": "x"}, {"answer": "x"}, {}])
    assert scores.total == [1.5, 0.5, None]
    m = scores.metrics()
    assert m["reward/unverifiable_frac"] == pytest.approx(1 / 3)
    assert m["reward/mean"] == pytest.approx(1.0)  # None is left out, not counted as 0


def test_module_function_reference_and_args(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    sys.modules.pop("my_rewards", None)
    scorer = RewardScorer([RewardSpec(fn="my_rewards:scaled", args={"scale": 3.0}, name="s")])
    assert scorer.score(["p"], ["c"], [{}]).total == [3.0]


def test_guard_replaces_the_total():
    spec = [RewardSpec(fn="exact_match"), RewardSpec(fn="safety_guard", args={"patterns": ["rm -rf"]})]
    scores = RewardScorer(spec).score(["p", "p"], ["rm -rf /", "ok"], [{"answer": "rm -rf /"}, {"answer": "ok"}])
    assert scores.total[1] == 1.0
    assert scores.total[0] < 0  # exact match earned 1.0, the guard floors it


@pytest.mark.parametrize("spec, message", [
    (RewardSpec(fn="exact_mtch"), "Did you mean 'exact_match'"),
    (RewardSpec(fn="nope.py:f"), "file not found"),
    (RewardSpec(fn="no_such_module_xyz:f"), "cannot import module"),
    (RewardSpec(fn="regex", args={"patern": "x"}), "bad args"),
])
def test_bad_reward_specs_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        RewardScorer([spec])


def test_duplicate_component_names_are_rejected():
    with pytest.raises(ConfigError, match="unique"):
        RewardScorer([RewardSpec(fn="exact_match"), RewardSpec(fn="exact_match")])


def test_non_finite_reward_is_an_error(user_file, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def nan(prompt, completion, **row):\n    return float('nan')\n")
    with pytest.raises(RewardError, match="non-finite"):
        RewardScorer([RewardSpec(fn=f"{bad}:nan")]).score(["p"], ["c"], [{}])


def test_pass_at_k_matches_the_combinatorial_definition():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the plain success rate
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_a_reference_completion_in_the_row_reaches_rewards_under_its_own_name(tmp_path):
    """Held-out rows often carry the reference answer as `completion`; it must not collide with
    the reward's positional `completion` argument."""
    from rlft.data.readers import Row
    from rlft.data.prompts import make_prompt_encoder
    from rlft.models.tiny import build_tokenizer

    example = make_prompt_encoder(build_tokenizer(), 64)(
        Row("f.jsonl:1", {"prompt": "What is 1 + 1?", "completion": "It is 2.", "answer": "2"}))
    assert example.fields == {"answer": "2", "reference_completion": "It is 2."}
    seen = {}

    def spy(prompt, completion, **row):
        seen.update(row, completion=completion)
        return 1.0

    scorer = RewardScorer([RewardSpec(fn="exact_match")])
    scorer.components = [("spy", spy, 1.0)]
    scorer.score(["What is 1 + 1?"], ["2"], [dict(example.fields, completion="stray")])
    assert seen["completion"] == "2" and seen["reference_completion"] == "It is 2."
