"""Preference pairs: tokenization like SFT, one validation report for bad rows, pair statistics,
and the example data written by `rlft.demo.arithmetic`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import write_jsonl
from rlft.config import ModelConfig
from rlft.demo.arithmetic import preference_rows, split_problems, worked_answer, write_preference_data
from rlft.data.readers import Row
from rlft.data.pairs import (PreferenceExample, TokenSequence, collate_pairs, make_preference_encoder,
                                  pair_statistics, read_pairs)
from rlft.data.sft_examples import encode_sft
from rlft.errors import DataError
from rlft.models.loading import load_tokenizer
from rlft.models.template import encode_prompt, end_of_turn_ids

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(qwen_path):
    return load_tokenizer(ModelConfig(path=str(qwen_path)))


def _encoder(tok, max_length=128, max_prompt_length=None):
    return make_preference_encoder(tok, end_of_turn_ids(tok), max_length, max_prompt_length)


def _targets(tok, side: TokenSequence) -> str:
    return tok.decode([t for t, m in zip(side.input_ids, side.target_mask) if m])


# -- tokenization -----------------------------------------------------------------------------

def test_each_side_is_tokenized_like_an_sft_row(tok):
    row = {"prompt": "What is 2 + 3?", "chosen": "The answer is 5.", "rejected": "It is 6.", "margin": 1}
    e = _encoder(tok)(Row("pairs.jsonl:1", row))
    prompt_ids = encode_prompt(tok, [{"role": "user", "content": "What is 2 + 3?"}])
    for side, text in ((e.chosen, "The answer is 5."), (e.rejected, "It is 6.")):
        ids, mask = encode_sft(tok, [{"role": "user", "content": "What is 2 + 3?"},
                                     {"role": "assistant", "content": text}], end_of_turn_ids(tok))
        assert (side.input_ids, side.target_mask) == (ids, mask)
        # the prompt is exactly what the model sees at generation time; the targets are the
        # answer and its end-of-turn token, not the newline the template writes after it
        assert side.input_ids[:len(prompt_ids)] == prompt_ids
        assert side.target_mask.index(1) == len(prompt_ids)
        assert _targets(tok, side) == text + "<|im_end|>"
    assert e.margin == 1.0 and isinstance(e.margin, float)


def test_the_tokens_are_the_ones_the_reward_model_reward_scores(tok):
    # rlft.rewards.reward_model renders [user: prompt, assistant: completion] and tokenizes the
    # whole text at once; a reward model must be trained on exactly those ids.
    from rlft.rewards.reward_model import render

    e = _encoder(tok)(Row("p:1", {"prompt": "What is 17 + 25?", "chosen": worked_answer(17, 25),
                                  "rejected": worked_answer(17, 25, added=0)}))
    for side, answer in ((e.chosen, worked_answer(17, 25)), (e.rejected, worked_answer(17, 25, added=0))):
        text, templated = render(tok, "What is 17 + 25?", answer)
        assert templated and tok(text, add_special_tokens=False)["input_ids"] == side.input_ids


def test_message_prompts_and_continuations(tok):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "What is 2 + 3?"}]
    row = {"prompt": history, "chosen": [{"role": "assistant", "content": "The answer is 5."}],
           "rejected": "It is 6."}
    e = _encoder(tok)(Row("p:1", row))
    # the assistant turn inside the prompt is context: only the continuation is a target
    assert _targets(tok, e.chosen) == "The answer is 5.<|im_end|>"
    assert _targets(tok, e.rejected) == "It is 6.<|im_end|>"
    assert e.chosen.input_ids[:e.chosen.target_mask.index(1)] == encode_prompt(tok, history)


def test_collate_puts_chosen_rows_first_then_rejected(tok):
    enc = _encoder(tok)
    examples = [enc(Row(f"p:{i}", {"prompt": f"What is {i} + 1?", "chosen": "x" * (i + 1), "rejected": "y"}))
                for i in range(3)]
    batch = collate_pairs(examples, tok.pad_token_id)
    width = max(len(s.input_ids) for e in examples for s in (e.chosen, e.rejected))
    assert batch["input_ids"].shape == (6, width)
    for i, e in enumerate(examples):
        for row, side in ((i, e.chosen), (i + 3, e.rejected)):
            n = len(side.input_ids)
            assert batch["input_ids"][row, :n].tolist() == side.input_ids
            assert batch["attention_mask"][row].sum() == n
            assert batch["target_mask"][row, :n].long().tolist() == side.target_mask
            assert not batch["target_mask"][row, n:].any()


# -- validation -------------------------------------------------------------------------------

def test_bad_rows_are_reported_in_one_error_with_file_and_line(tmp_path, tok):
    good = preference_rows(split_problems()[0][:12], seed=3)
    lines = [good[0],
             {"prompt": "What is 1 + 1?", "rejected": "3"},                              # 2: no chosen
             good[1],
             {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "  "},               # 4: empty rejected
             {"prompt": "What is 1 + 1?", "chosen": 2, "rejected": "3"},                  # 5: wrong type
             {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2"},                # 6: identical
             good[2],
             {"prompt": "Add " + " + ".join(["12345"] * 30), "chosen": "1", "rejected": "2"},  # 8: too long
             '{"prompt": "What is 1 + 1?", "chosen": "2"',                               # 9: bad JSON
             {"prompt": "q", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},  # 10: not assistant
             {"prompt": "q", "chosen": "2", "rejected": "3", "margin": "big"},            # 11: bad margin
             {"prompt": "q", "chosen": [{"role": "assistant"}], "rejected": "3"},         # 12: malformed
             '{"prompt": "q", "chosen": "2", "rejected": "3", "margin": NaN}',            # 13: NaN margin
             *good[3:]]
    path = write_jsonl(tmp_path / "pairs.jsonl", lines)
    with pytest.raises(DataError) as info:
        read_pairs(str(path), "train", tok, end_of_turn_ids(tok), 64, None, "error", "preference")
    message = str(info.value)
    assert f"{path}: 10 of {len(lines)} preference rows are invalid" in message
    expected = {2: "missing field 'chosen'", 4: "empty 'rejected'", 5: "wrong type for 'chosen'",
                6: "chosen and rejected are identical", 8: "longer than data.max_length (64 tokens)",
                9: "bad JSON", 10: "'chosen' does not end with an assistant turn", 11: "wrong type for 'margin'",
                12: "malformed 'chosen'", 13: "'margin' is not finite"}
    for line, reason in expected.items():
        assert reason in message and f"{path}:{line}" in message, (line, reason)
    assert "data.on_invalid=drop" in message
    for line in (1, 3, 7):
        assert f"{path}:{line}\n" not in message and f"{path}:{line}:" not in message

    kept, stats = read_pairs(str(path), "train", tok, end_of_turn_ids(tok), 64, None, "drop", "preference")
    assert len(kept) == len(good) and stats["pairs"] == len(good)


def test_a_template_failure_and_a_long_prompt_are_row_errors(qwen_path):
    from rlft.data.validate import RowError

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    tok.chat_template = ("{%- for m in messages %}{%- if m['content'] == 'boom' %}"
                         "{{ raise_exception('no boom here') }}{%- endif %}"
                         "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    enc = _encoder(tok, max_prompt_length=12)
    with pytest.raises(RowError) as info:
        enc(Row("p:1", {"prompt": "q", "chosen": "boom", "rejected": "fine"}))
    assert info.value.reason == "chat template failed" and "no boom here" in info.value.detail
    with pytest.raises(RowError, match="prompt longer than data.max_prompt_length"):
        enc(Row("p:2", {"prompt": "What is 12 + 34 + 56 + 78?", "chosen": "a", "rejected": "b"}))


# -- pair statistics --------------------------------------------------------------------------

def _pair(chosen_len: int, rejected_len: int, tag: int = 0) -> PreferenceExample:
    # prompt token [tag], then the answer; ids distinguish the pair, lengths are answer tokens
    return PreferenceExample("p", TokenSequence([tag] + [1] * chosen_len, [0] + [1] * chosen_len),
                             TokenSequence([tag] + [2] * rejected_len, [0] + [1] * rejected_len), None)


def test_pair_statistics_hand_computed(caplog):
    examples = [_pair(10, 10, 0),   # equal
                _pair(10, 6, 1),    # |10 - 6| = 4 > 0.3 * 10: imbalanced, chosen longer
                _pair(10, 8, 2),    # 2 <= 3: balanced, chosen longer
                _pair(5, 10, 3),    # imbalanced, rejected longer
                _pair(10, 6, 1)]    # duplicate of the second pair
    flipped = PreferenceExample("p", examples[2].rejected, examples[2].chosen, None)  # third pair swapped
    examples.append(flipped)        # 8 vs 10: balanced, rejected longer
    with caplog.at_level(logging.WARNING):
        stats = pair_statistics(examples, "pairs.jsonl")
    assert stats == {"pairs": 6.0, "length_imbalanced": 3 / 6, "chosen_longer": 3 / 6, "rejected_longer": 2 / 6,
                     "duplicate_pairs": 1.0, "contradictory_pairs": 1.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one report for the dataset
    text = warnings[0].getMessage()
    assert "50% of pairs differ in answer length by more than 30%" in text
    assert "1 duplicate pairs" in text and "1 pairs contradict" in text
    assert "length bias" not in text  # chosen longer in 3, rejected in 2: |3 - 2| / 6 < 0.3


def test_length_bias_warning(caplog):
    examples = [_pair(12, 10, i) for i in range(8)] + [_pair(10, 10, 8 + i) for i in range(2)]
    with caplog.at_level(logging.WARNING):
        stats = pair_statistics(examples, "pairs.jsonl")
    assert stats["chosen_longer"] == 0.8 and stats["rejected_longer"] == 0.0
    assert stats["length_imbalanced"] == 0.0  # 2 <= 0.3 * 12
    assert "the chosen answer is longer in 80% of pairs and the rejected in 0%" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pair_statistics([_pair(10, 10, i) for i in range(4)], "clean.jsonl")
    assert caplog.text == ""


# -- example data -----------------------------------------------------------------------------

def test_arithmetic_pairs_are_hard_negatives():
    assert worked_answer(53, 98) == "3+8=11, carry 1. 5+9+1=15. The answer is 151."
    assert worked_answer(53, 98, added=0) == "3+8=11, carry 1. 5+9+0=14. The answer is 141."
    rows = preference_rows(split_problems()[0][:300], seed=0)
    assert {r["kind"] for r in rows} == {"forgot_carry", "spurious_carry", "wrong_final"}
    for r in rows:
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
        assert r["chosen"] == worked_answer(a, b) and r["chosen"].endswith(f"is {a + b}.")
        assert r["rejected"] != r["chosen"] and not r["rejected"].endswith(f"is {a + b}.")
        assert abs(len(r["chosen"]) - len(r["rejected"])) <= 2  # a digit in the sum and one in the answer


def test_example_data_is_what_the_generator_writes(tmp_path):
    # examples/dpo.yaml and examples/reward_model.yaml read these files; regenerate them with
    # rlft.demo.arithmetic.write_preference_data("examples/data", **EXAMPLE_DATA)
    from rlft.demo.arithmetic import EXAMPLE_DATA

    written = write_preference_data(tmp_path, **EXAMPLE_DATA)
    for path in written.values():
        assert (REPO / "examples" / "data" / path.name).read_bytes() == path.read_bytes(), path.name
    train = [json.loads(x) for x in written["train"].read_text().splitlines()]
    heldout = [json.loads(x) for x in written["heldout"].read_text().splitlines()]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
