"""Model-sampled preference pairs: best vs worst above a margin, skips counted, rows that rlft's
own preference reader accepts."""

from __future__ import annotations

import json

import pytest

from rlft.data.readers import Row
from rlft.data.prompts import PromptExample
from rlft.data.sampled_pairs import best_and_worst, sample_pairs, write_pairs

# scores of the 4 samples of each prompt
SCORES = [
    [0.2, 0.9, 0.5, 0.1],  # best 1 (0.9), worst 3 (0.1): gap 0.8
    [0.5, 0.55, 0.5, 0.52],  # gap 0.05 <= margin 0.1: skipped
    [None, 0.7, None, None],  # one scored sample: skipped
    [1.0, None, 0.0, 1.0],  # ties: the first best (0) and the first worst (2): gap 1.0
    [0.0, 1.0, 0.0, 0.0],  # best and worst identical texts (see TEXTS): skipped
]
TEXTS = {4: ["same", "same", "same", "same"]}


def sample(examples, k):
    return [TEXTS.get(e.prompt_ids[0], [f"answer {e.prompt_ids[0]}.{j}" for j in range(k)])[j]
            for e in examples for j in range(k)]


def score(example, texts):
    return SCORES[example.prompt_ids[0]]


def prompts():
    out = [PromptExample(f"p.jsonl:{i + 1}", [{"role": "user", "content": f"question {i}"}], [i]) for i in range(5)]
    out[3] = PromptExample("p.jsonl:4", [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "question 3"}], [3])
    return out


def test_best_and_worst():
    assert best_and_worst([0.2, 0.9, None, 0.1]) == (1, 3)
    assert best_and_worst([1.0, 0.0, 1.0, 0.0]) == (0, 1)  # the first of equals
    assert best_and_worst([None, 0.3]) is None


def test_pairs_and_skip_counts():
    rows, counts = sample_pairs(prompts(), sample, score, n=4, margin=0.1, batch_prompts=2)
    assert counts.prompts == 5 and counts.pairs == 2
    assert counts.skipped == {"unscored": 1, "small_gap": 1, "identical": 1}
    first, second = rows
    assert first == {"prompt": "question 0", "chosen": "answer 0.1", "rejected": "answer 0.3",
                     "margin": pytest.approx(0.8)}
    # a conversation with a system turn stays a list of messages
    assert second["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question 3"}]
    assert (second["chosen"], second["rejected"], second["margin"]) == ("answer 3.0", "answer 3.2", 1.0)
    # margin 0: a positive gap is enough, so prompt 1 (gap 0.05) gives a pair too
    assert sample_pairs(prompts(), sample, score, n=4, margin=0.0)[1].pairs == 3


def test_rows_are_rlft_preference_rows(tmp_path, qwen_path):
    from rlft.config import ModelConfig
    from rlft.data.pairs import make_preference_encoder
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import end_of_turn_ids

    rows, _ = sample_pairs(prompts(), sample, score, n=4, margin=0.1)
    path = write_pairs(rows, tmp_path / "pairs.jsonl")
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    encode = make_preference_encoder(tok, end_of_turn_ids(tok), max_length=256)
    for i, line in enumerate(path.read_text().splitlines()):
        example = encode(Row(f"{path}:{i + 1}", json.loads(line)))
        assert example.margin == pytest.approx(rows[i]["margin"])


def test_bad_settings():
    with pytest.raises(ValueError, match="at least 2"):
        sample_pairs(prompts(), sample, score, n=1)
    with pytest.raises(ValueError, match="margin"):
        sample_pairs(prompts(), sample, score, n=4, margin=-1)


def test_rlft_data_pairs_command(tmp_path, qwen_path, monkeypatch):
    import typer
    import yaml
    from typer.testing import CliRunner

    import rlft.cli.data as cli_data
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt
    from rlft.rewards.scoring import Scores

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    index = {tuple(encode_prompt(tok, [{"role": "user", "content": f"question {i}"}])): i for i in range(5)}

    class Plumbing:
        tokenizer = tok

        def sample(self, examples, k):
            return sample([PromptExample(e.where, e.messages, [index[tuple(e.prompt_ids)]]) for e in examples], k)

        def rewards(self, examples, texts):
            values = SCORES[int(examples[0].prompt_text.split()[-1])]
            return Scores(list(values), {})

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"method": "grpo", "output_dir": str(tmp_path / "run"),
                                      "model": {"path": str(qwen_path)}, "data": {"train": str(data)},
                                      "rewards": [{"fn": "exact_match"}]}))
    monkeypatch.setattr(cli_data, "default_plumbing", lambda cfg: Plumbing())
    app = typer.Typer()
    cli_data.register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "pairs.jsonl"
    result = CliRunner().invoke(app, ["data", "pairs", str(config), "--samples", "4", "--margin", "0.1",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 pairs from 5 prompts" in result.output and "skipped 3" in result.output
    assert [json.loads(x)["chosen"] for x in out.read_text().splitlines()] == ["answer 0.1", "answer 3.0"]
