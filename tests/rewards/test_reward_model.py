"""The `reward_model` reward on a tiny random Qwen2 sequence classifier built here."""

import math

import pytest
import torch

from rlft.config import RewardSpec
from rlft.errors import RlftError
from rlft.models.tiny import build_tokenizer
from rlft.rewards import RewardScorer
from rlft.rewards.scoring import BUILTIN_REWARDS

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Hi", "Sum 10 and 5, show the steps.", "x"]
COMPLETIONS = ["4", "Blue, or maybe green.", "Hello there, how can I help you today?", "10 + 5 = 15", ""]


def _save(path, with_template: bool):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_tokenizer(256)
    if not with_template:
        tokenizer.chat_template = None
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    model, tokenizer = _save(path, with_template=True)
    return str(path), model, tokenizer


def _direct_score(model, tokenizer, text: str, add_special_tokens: bool) -> float:
    ids = tokenizer(text, add_special_tokens=add_special_tokens, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits[0, 0].item()


def test_scores_match_a_direct_forward_of_the_chat_rendering(tiny_rm):
    path, model, tokenizer = tiny_rm
    fn = BUILTIN_REWARDS["reward_model"](path=path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]},
                                          {"role": "assistant", "content": COMPLETIONS[0]}], tokenize=False)
    assert "<|im_start|>assistant\n4<|im_end|>" in text
    assert fn(PROMPTS[0], COMPLETIONS[0]) == pytest.approx(_direct_score(model, tokenizer, text, False), rel=1e-4)


def test_the_whole_conversation_is_scored_when_the_trainer_passes_it(tiny_rm):
    # a system prompt and earlier turns reach the RM (it was trained on whole conversations);
    # the positional prompt is only the last message
    path, model, tokenizer = tiny_rm
    fn = BUILTIN_REWARDS["reward_model"](path=path)
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": PROMPTS[0]}]
    text = tokenizer.apply_chat_template(conversation + [{"role": "assistant", "content": "4"}], tokenize=False)
    whole = fn(PROMPTS[0], "4", messages=conversation)
    assert whole == pytest.approx(_direct_score(model, tokenizer, text, False), rel=1e-4)
    assert whole != pytest.approx(fn(PROMPTS[0], "4"), rel=1e-4)  # the last message alone scores differently


def test_batching_and_padding_do_not_change_scores(tiny_rm):
    path, _, _ = tiny_rm
    batched = BUILTIN_REWARDS["reward_model"](path=path, batch_size=3)
    single = BUILTIN_REWARDS["reward_model"](path=path, batch_size=1)
    rows = [{}] * len(PROMPTS)
    assert batched.batch(PROMPTS, COMPLETIONS, rows) == pytest.approx(single.batch(PROMPTS, COMPLETIONS, rows),
                                                                      rel=1e-4, abs=1e-6)
    assert len(set(round(s, 6) for s in single.batch(PROMPTS, COMPLETIONS, rows))) > 1  # not a constant


def test_without_a_chat_template_prompt_and_completion_are_concatenated(tmp_path):
    model, tokenizer = _save(tmp_path, with_template=False)
    fn = BUILTIN_REWARDS["reward_model"](path=str(tmp_path))
    expected = _direct_score(model, tokenizer, PROMPTS[3] + COMPLETIONS[3], True)
    assert fn(PROMPTS[3], COMPLETIONS[3]) == pytest.approx(expected, rel=1e-4)


def test_length_normalisation_and_clip(tiny_rm):
    path, _, tokenizer = tiny_rm
    plain = BUILTIN_REWARDS["reward_model"](path=path)
    normed = BUILTIN_REWARDS["reward_model"](path=path, length_coef=0.5)
    completion = COMPLETIONS[2]
    n = len(tokenizer(completion, add_special_tokens=False)["input_ids"])
    # score - 0.5 × ln(1 + n)
    assert normed(PROMPTS[2], completion) == pytest.approx(plain(PROMPTS[2], completion) - 0.5 * math.log1p(n), rel=1e-4)
    clipped = BUILTIN_REWARDS["reward_model"](path=path, length_coef=100.0, clip=1.0)
    assert clipped(PROMPTS[2], completion) == -1.0


def test_the_scorer_uses_the_batch_path(tiny_rm):
    path, _, _ = tiny_rm
    scorer = RewardScorer([RewardSpec(fn="reward_model", args={"path": path, "batch_size": 2})])
    scores = scorer.score(PROMPTS, COMPLETIONS, [{}] * len(PROMPTS))
    direct = BUILTIN_REWARDS["reward_model"](path=path)
    assert scores.total == pytest.approx([direct(p, c) for p, c in zip(PROMPTS, COMPLETIONS)], rel=1e-4, abs=1e-6)


def test_errors_name_the_problem(tiny_rm, tmp_path):
    with pytest.raises(RlftError, match="args.path '.*missing': no such folder"):
        BUILTIN_REWARDS["reward_model"](path=str(tmp_path / "missing"))
    with pytest.raises(RlftError, match="label 3 out of range"):
        BUILTIN_REWARDS["reward_model"](path=tiny_rm[0], label=3)
