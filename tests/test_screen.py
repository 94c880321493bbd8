"""Difficulty screening with a scripted sampler whose pass rates are known exactly, its files,
histogram and the `rlft data screen` command."""

from __future__ import annotations

import json

import pytest
import typer
import yaml
from typer.testing import CliRunner

from rlft.data.readers import read_rows
from rlft.data.prompts import PromptExample
from rlft.data.screen import pass_rate_histogram, screen_prompts, write_screen
from rlft.rewards.scoring import Scores

K = 10
# prompt i is solved by its first SOLVED[i] samples of 10: pass rates 0, 0.1, 0.5, 0.9, 1.0, 0.3
SOLVED = [0, 1, 5, 9, 10, 3]


def scripted_sample(examples, k):
    """Completion j of the prompt whose first token id is p reads 'p:j'."""
    return [f"{e.prompt_ids[0]}:{j}" for e in examples for j in range(k)]


def solved(text: str) -> bool:
    p, j = map(int, text.split(":"))
    return j < SOLVED[p]


def examples(n=len(SOLVED)):
    return [PromptExample(f"rows.jsonl:{i + 1}", [{"role": "user", "content": f"q{i}"}], [i, 99]) for i in range(n)]


def test_pass_rates_and_bounds_are_inclusive():
    result = screen_prompts(examples(), scripted_sample, lambda e, text: solved(text), k=K, low=0.1, high=0.9,
                            batch_prompts=4)  # two sampler calls: 4 + 2 prompts
    assert [r.pass_rate for r in result.rates] == [0.0, 0.1, 0.5, 0.9, 1.0, 0.3]
    # 0.1 and 0.9 sit on the bounds and are kept
    assert result.kept == [False, True, True, True, False, True]
    assert result.counts == {"kept": 4, "too_easy": 1, "too_hard": 1, "unscored": 0}


def test_rewards_use_the_threshold_and_none_is_left_out():
    def score(example, text):
        p, j = map(int, text.split(":"))
        if j >= 8:
            return None  # unverifiable: not part of the pass rate
        return 1.0 if j < SOLVED[p] else 0.5

    result = screen_prompts(examples(), scripted_sample, score, k=K, threshold=0.75)
    # of the 8 scored samples, min(SOLVED, 8) are correct: 0, 1, 5, 8, 8, 3 of 8
    assert [r.scored for r in result.rates] == [8] * 6
    assert [r.correct for r in result.rates] == [0, 1, 5, 8, 8, 3]
    nothing = screen_prompts(examples(1), scripted_sample, lambda e, t: None, k=3)
    assert nothing.counts["unscored"] == 1 and nothing.kept == [False]


def test_histogram_bins():
    text = pass_rate_histogram([0.0, 0.1, 0.5, 0.9, 1.0, 0.3], bins=10, width=10)
    lines = text.splitlines()
    assert len(lines) == 10
    # 0.0 -> bin 0, 0.1 -> bin 1, 0.3 -> bin 3, 0.5 -> bin 5, 0.9 and 1.0 -> the last bin (closed)
    assert [int(line.split()[-1]) for line in lines] == [1, 1, 0, 1, 0, 1, 0, 0, 0, 2]
    assert lines[-1].startswith("[0.9, 1.0]") and lines[0].startswith("[0.0, 0.1)")


def test_written_rows_are_the_original_lines(tmp_path):
    source = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "answer": i * 1.0, "extra": {"k": [1, 2]}}, indent=None) + "  "
             for i in range(len(SOLVED))]  # trailing spaces and 0.0-style floats: kept as written
    source.write_text("\n".join(lines) + "\n")
    rows = read_rows(str(source))
    result = screen_prompts(examples(), scripted_sample, lambda e, text: solved(text), k=K)
    kept_path, rates_path = write_screen(rows, result, tmp_path / "out" / "kept.jsonl")
    assert kept_path.read_text().splitlines() == [lines[i] for i in (1, 2, 3, 5)]
    rates = [json.loads(x) for x in rates_path.read_text().splitlines()]
    assert rates_path.name == "kept.pass_rates.jsonl"
    assert [r["pass_rate"] for r in rates] == [0.0, 0.1, 0.5, 0.9, 1.0, 0.3]
    assert [r["where"] for r in rates] == [f"rows.jsonl:{i + 1}" for i in range(6)]
    assert [r["kept"] for r in rates] == result.kept


def test_bad_bounds():
    with pytest.raises(ValueError, match="low <= high"):
        screen_prompts(examples(), scripted_sample, lambda e, t: True, low=0.8, high=0.2)


class FakePlumbing:
    """The `Plumbing` protocol with the scripted sampler, keyed by the prompts' token ids."""

    def __init__(self, tokenizer):
        from rlft.models.template import encode_prompt

        self.tokenizer = tokenizer
        self.correct_component = "solved"
        self.index = {tuple(encode_prompt(tokenizer, [{"role": "user", "content": f"q{i}"}])): i
                      for i in range(len(SOLVED))}

    def sample(self, examples, k):
        return [f"{self.index[tuple(e.prompt_ids)]}:{j}" for e in examples for j in range(k)]

    def rewards(self, examples, texts):
        values = [float(solved(t)) for t in texts]
        return Scores(values, {"solved": values})


def test_rlft_data_screen_command(tmp_path, qwen_path, monkeypatch):
    import rlft.cli.data as cli_data
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(len(SOLVED))))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"method": "grpo", "output_dir": str(tmp_path / "run"),
                                      "model": {"path": str(qwen_path)}, "data": {"train": str(data)},
                                      "rewards": [{"fn": "exact_match"}]}))
    monkeypatch.setattr(cli_data, "default_plumbing", lambda cfg: FakePlumbing(tok))
    app = typer.Typer()
    cli_data.register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "kept.jsonl"
    result = CliRunner().invoke(app, ["data", "screen", str(config), "--samples", "10", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "kept 4, too easy 1 (> 0.9), too hard 1 (< 0.1)" in result.output
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == ["q1", "q2", "q3", "q5"]
