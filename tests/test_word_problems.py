"""The real-model demo's data and arithmetic: word problems deterministic by seed, a held-out split
disjoint from training, answers right by construction (checked against the numbers in the
rendered question, not against the generator's own formula), and the demo's config and paired
standard error. None of this loads the SmolLM2 model."""

from __future__ import annotations

import json
import math
import re

import pytest

from rlft.demo import smollm2, word_problems as wp


def _key(row):
    return row["op"], row["a"], row["b"]


def _question(row) -> str:
    return row["prompt"][-1]["content"]


def test_same_seed_same_rows_and_another_seed_differs():
    first = wp.make_splits(seed=3, train_rows=200, heldout_rows=50)
    assert first == wp.make_splits(seed=3, train_rows=200, heldout_rows=50)
    other = wp.make_splits(seed=4, train_rows=200, heldout_rows=50)
    assert [_key(r) for r in other["heldout"]] != [_key(r) for r in first["heldout"]]


def test_heldout_is_disjoint_from_train_and_neither_repeats_a_problem():
    splits = wp.make_splits(seed=0, train_rows=1000, heldout_rows=300)
    train, heldout = [_key(r) for r in splits["train"]], [_key(r) for r in splits["heldout"]]
    assert len(train) == 1000 and len(heldout) == 300
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert not set(train) & set(heldout)


def test_answers_are_right_for_the_numbers_in_the_question():
    rows = wp.make_splits(seed=1, train_rows=300, heldout_rows=100)["train"]
    for row in rows:
        text = _question(row)
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        assert sorted(numbers) == sorted([row["a"], row["b"]]), text  # both operands, nothing else
        a, b = row["a"], row["b"]
        expected = {"+": a + b, "-": a - b, "*": a * b}[row["op"]]
        assert row["answer"] == str(expected) and expected >= 0, text
    assert {r["op"] for r in rows} == {lv.op for lv in wp.DEFAULT_LEVELS}


def test_hand_computed_answers_and_operand_ranges():
    assert wp.answer_of("+", 47, 38) == 85
    assert wp.answer_of("-", 50, 7) == 43
    assert wp.answer_of("*", 12, 9) == 108
    level = wp.Level("-", (10, 12), (2, 11))
    rng = wp.random.Random(0)
    for _ in range(200):
        op, a, b = wp.draw_problem(rng, level)
        assert 10 <= a <= 12 and 2 <= b < a  # subtraction never goes negative


def test_ranges_too_narrow_for_the_row_count_raise():
    tiny = (wp.Level("+", (1, 2), (1, 2)),)  # 4 distinct problems only
    with pytest.raises(ValueError, match="too narrow"):
        wp.make_splits(seed=0, train_rows=3, heldout_rows=3, levels=tiny)


def test_the_system_prompts_example_is_format_compliant_and_scores_as_right():
    from rlft.rewards.math import math_reward

    worked = "12 + 5 = 17. The answer is 17."
    assert worked in wp.SYSTEM_PROMPT
    assert re.fullmatch(wp.FORMAT_REGEX, worked)
    assert not re.fullmatch(wp.FORMAT_REGEX, "12 + 5 = 17")
    math_fn = math_reward()
    assert math_fn("q", worked, answer="17") == 1.0
    assert math_fn("q", "12 + 5 = 18. The answer is 18.", answer="17") == 0.0


def test_write_splits_files_read_back(tmp_path):
    paths = wp.write_splits(tmp_path, seed=2, train_rows=20, heldout_rows=10)
    rows = [json.loads(line) for line in paths["heldout"].read_text().splitlines()]
    assert len(rows) == 10 and rows[0]["prompt"][0] == {"role": "system", "content": wp.SYSTEM_PROMPT}


def test_paired_gain_hand_computed():
    # before 1,0,0,0 / after 1,1,1,0: differences 0,1,1,0, mean 0.5; sample variance
    # (4 x 0.25) / 3 = 1/3; standard error sqrt((1/3) / 4) = sqrt(1/12) = 0.288675
    gain, se = smollm2.paired_gain([True, False, False, False], [True, True, True, False])
    assert gain == 0.5 and se == pytest.approx(math.sqrt(1 / 12))


def test_demo_config_is_a_valid_rlft_config(tmp_path):
    from rlft.config import load_config

    data = wp.write_splits(tmp_path / "data", seed=0, train_rows=20, heldout_rows=10)
    cfg = load_config(smollm2.grpo_config(tmp_path / "run", tmp_path / "model", data, smollm2.Smollm2Settings()))
    assert cfg.method == "grpo" and cfg.lora.enabled
    assert cfg.data.eval == str(data["heldout"]) and cfg.eval.format_regex == wp.FORMAT_REGEX


def test_missing_package_is_one_clear_error(monkeypatch):
    from rlft.errors import RlftError

    monkeypatch.setattr(smollm2, "PACKAGE", "no_such_package_rlft_test")
    with pytest.raises(RlftError, match="pip install"):
        smollm2.find_gguf()


def test_the_example_config_trains_what_the_demo_trains():
    from pathlib import Path

    from rlft.config import load_config

    example = load_config(Path(__file__).parents[1] / "examples" / "smollm2_grpo.yaml")
    data = {"train": Path(example.data.train), "heldout": Path(example.data.eval)}
    demo = load_config(smollm2.grpo_config(Path(example.output_dir), Path(example.model.path), data,
                                           smollm2.Smollm2Settings()))
    for section in ("lora", "training", "rollout", "algorithm", "eval", "rewards"):
        assert getattr(example, section) == getattr(demo, section), section


def test_summary_and_printout_from_recorded_evaluations(tmp_path, capsys):
    from rlft.eval.generation import EvalResult

    metrics = {"heldout/format_compliance": 0.5, "heldout/length_mean": 30.0, "heldout/truncation_rate": 0.1}

    def rec(ok: bool) -> dict:
        return {"prompt": "<|im_start|>user\nQ?<|im_end|>", "completion": "1 + 1 = 2. The answer is 2.", "correct": ok}

    base = EvalResult(metrics, [rec(True), rec(False), rec(False), rec(False)])
    trained = EvalResult(metrics, [rec(True), rec(True), rec(True), rec(False)])
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward/correct": 0.25, "time/step": 10.0, "time/train": 4.0}) + "\n")
    times = {"import": 0.0, "base_eval": 1.0, "train": 2.0, "trained_eval": 3.0, "total_without_import": 6.0}
    res = smollm2.summarize(base, trained, tmp_path / "metrics.jsonl", smollm2.Smollm2Settings(), times)
    # base 1/4 right: s.e. sqrt(0.25 x 0.75 / 4) = 0.2165; trained 3/4; the paired gain as hand-computed above
    assert res["base"]["accuracy"] == 0.25 and res["trained"]["accuracy"] == 0.75
    assert res["base"]["accuracy_se"] == pytest.approx(0.216506, abs=1e-6) and res["gain"] == 0.5
    assert res["seconds"]["steps_generation_and_scoring"] == 6.0  # 10 s step - 4 s update
    json.dumps(res)
    smollm2.print_results(res, tmp_path)
    assert "gain +0.500 ± 0.289" in capsys.readouterr().err  # the console writes to stderr
