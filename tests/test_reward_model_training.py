"""Reward-model training: the sequence-classifier loader, pooling at the last real token, the
Bradley-Terry loss with margin and centering, gradient accumulation, learning a held-out
preference, the export as a `reward_model` reward, LoRA with a merged head, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import big_and_micro_batches, make_config, take_grads, write_jsonl
from rlft import api
from rlft.config import DataConfig, LoraConfig, ModelConfig, RewardModelConfig, RewardSpec, load_config
from rlft.demo.arithmetic import preference_rows, split_problems
from rlft.data.readers import Row
from rlft.data.pairs import PreferenceExample, TokenSequence, collate_pairs, make_preference_encoder
from rlft.models.loading import load_reward_model, load_tokenizer
from rlft.models.template import end_of_turn_ids
from rlft.rewards.scoring import RewardScorer
from rlft.training.offline.reward_model import RewardModelObjective, pair_scores
from rlft.training.offline.loop import make_objective


def rm_config(model_path, train, out, **sections):
    config = make_config(model_path, train, out, **sections)
    config["method"] = "reward_model"
    return config


def carry_pairs(problems, seed):
    """'carry stated and added' (chosen) vs 'carry stated, then forgotten' (rejected)."""
    return preference_rows(problems, seed, kinds=("forgot_carry",))


def _objective(tok, margin=0.0, center=0.0) -> RewardModelObjective:
    objective = RewardModelObjective(DataConfig(train="unused.jsonl"),
                                     RewardModelConfig(margin=margin, center_coef=center), chunk=4)
    objective.pad_id = tok.pad_token_id
    return objective


@pytest.fixture(scope="module")
def tok(qwen_path):
    return load_tokenizer(ModelConfig(path=str(qwen_path)))


@pytest.fixture(scope="module")
def examples(tok):
    """Pairs of different lengths (so batches carry padding), some with their own margin."""
    rows = preference_rows(split_problems()[0][:40], seed=5)[:8]
    for i, r in enumerate(rows):
        r["prompt"] += " Show the steps." * (i % 3)
        if i % 2:
            r["margin"] = 0.5 * i
    enc = make_preference_encoder(tok, end_of_turn_ids(tok), max_length=256)
    return [enc(Row(f"pairs.jsonl:{i + 1}", r)) for i, r in enumerate(rows)]


# -- model ------------------------------------------------------------------------------------

def test_reward_model_loader_adds_a_head_and_sets_the_pad_id(qwen_path):
    full = load_reward_model(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())
    assert type(full.model).__name__ == "Qwen2ForSequenceClassification"
    assert full.model.config.num_labels == 1
    assert full.model.config.pad_token_id == full.tokenizer.pad_token_id
    assert all(p.requires_grad for p in full.model.parameters())

    lora = load_reward_model(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig(enabled=True, r=4))
    trainable = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    # the new head is trained in full (modules_to_save), the body through adapters only
    assert any(".score." in n and "modules_to_save" in n for n in trainable)
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("lora_A" in n for n in trainable)


def test_scores_are_read_at_each_rows_last_real_token(qwen_path, tok, examples):
    model = load_reward_model(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig()).model.double().eval()
    batch = collate_pairs(examples, tok.pad_token_id)
    assert (batch["attention_mask"] == 0).any()  # right padding present
    with torch.no_grad():
        scores = pair_scores(model, batch)  # [16]
        sides = [e.chosen for e in examples] + [e.rejected for e in examples]
        alone = [float(model(input_ids=torch.tensor([s.input_ids])).logits[0, 0]) for s in sides]
    torch.testing.assert_close(scores, torch.tensor(alone, dtype=torch.float64), rtol=1e-9, atol=1e-9)


# -- loss -------------------------------------------------------------------------------------

def test_margin_and_centering_hand_computed(tok):
    objective = _objective(tok, margin=0.25, center=0.1)
    empty = TokenSequence([0], [0])
    pairs = [PreferenceExample("a", empty, empty, None), PreferenceExample("b", empty, empty, 0.5)]
    chosen, rejected = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0])
    loss, metrics = objective._pair_losses(chosen, rejected, pairs)
    # pair a: diff 1, default margin 0.25 -> log(1 + e^-0.75) = 0.386871; center 0.1 * (2 + 1)^2 = 0.9
    # pair b: diff -0.5, row margin 0.5 -> log(1 + e^1) = 1.313262; center 0.1 * (0.5 + 1)^2 = 0.225
    torch.testing.assert_close(loss, torch.tensor([0.386871 + 0.9, 1.313262 + 0.225]), rtol=1e-5, atol=1e-6)
    assert metrics["rm/accuracy"] == 0.5 and metrics["rm/margin"] == pytest.approx(0.25)  # (1 - 0.5) / 2
    assert metrics["scores/chosen"] == pytest.approx(1.25) and metrics["scores/rejected"] == pytest.approx(1.0)


def test_micro_batches_give_the_big_batch_gradient(qwen_path, tok, examples):
    model = load_reward_model(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig()).model.double().train()
    objective = _objective(tok, margin=0.5, center=0.01)
    norm = objective.normaliser(examples)
    assert norm == 8.0

    run = big_and_micro_batches(objective, model, examples, norm)
    big, micro, m_big, m_micro = run.grads_big, run.grads_micro, run.metrics_big, run.metrics_micro
    assert run.loss_micro == pytest.approx(run.loss_big, rel=1e-9)
    for key, value in m_big.items():
        assert m_micro[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert big.keys() == micro.keys() and "score.weight" in big
    scale = max(float(g.abs().max()) for g in big.values())
    for name in big:  # the whole computation is float64 here: agreement to rounding
        torch.testing.assert_close(micro[name], big[name], rtol=1e-5, atol=1e-9 * scale, msg=name)

    for i in range(0, 8, 2):  # control: a mean per micro-batch is a different gradient
        loss, _ = objective.loss(model, examples[i:i + 2], 2.0)
        loss.backward()
    wrong = take_grads(model)
    rel = max(float((wrong[n] - big[n]).norm() / big[n].norm()) for n in big if big[n].norm() > 0)
    assert rel > 1e-2


# -- learning and export ----------------------------------------------------------------------

def test_reward_model_learns_and_its_export_scores_as_a_reward(tmp_path, qwen_path):
    from transformers import AutoModelForSequenceClassification

    train_problems, heldout_problems = split_problems(seed=0, heldout=200)
    train = write_jsonl(tmp_path / "train.jsonl", carry_pairs(train_problems[:200], 1))
    heldout_rows = carry_pairs(heldout_problems, 2)[:64]
    heldout = write_jsonl(tmp_path / "heldout.jsonl", heldout_rows)
    # fp32: the export is scored in fp32 by the reward scorer and compared with the eval the run did
    config = load_config(rm_config(qwen_path, train, tmp_path / "rm", data={"eval": str(heldout)},
                                   training={"batch_size": 8, "max_steps": 10, "learning_rate": 1e-3,
                                             "precision": "fp32"}))
    policy = load_reward_model(config.model, config.lora)
    start = make_objective(config)
    _, evals, _ = start.prepare(policy)
    before = start.evaluate(policy, evals)
    assert before["eval/accuracy"] < 0.8  # a random head

    summary = api.train(config)
    assert summary["status"] == "completed"
    assert summary["eval/accuracy"] >= 0.9 and summary["eval/margin"] > 1.0
    saved = json.loads((tmp_path / "rm" / "summary.json").read_text())
    assert saved["eval/accuracy"] == summary["eval/accuracy"] and saved["data/eval/pairs"] == 64

    final = tmp_path / "rm" / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    assert model.config.num_labels == 1 and model.config.pad_token_id == policy.tokenizer.pad_token_id
    assert (final / "rlft_template.json").is_file() and (final / "tokenizer.json").is_file()

    # rewards: [{fn: reward_model, args: {path: .../final}}] scores held-out chosen above rejected
    scorer = RewardScorer([RewardSpec(fn="reward_model", name="rm", args={"path": str(final), "batch_size": 16})])
    prompts = [r["prompt"] for r in heldout_rows]
    chosen = scorer.score(prompts, [r["chosen"] for r in heldout_rows], [{}] * 64).total
    rejected = scorer.score(prompts, [r["rejected"] for r in heldout_rows], [{}] * 64).total
    wins = sum(c > r for c, r in zip(chosen, rejected)) / 64
    assert wins == summary["eval/accuracy"]  # the same tokens and the same pooling as in training
    # and the same numbers: the export scores a pair as the trained model did
    enc = make_preference_encoder(policy.tokenizer, end_of_turn_ids(policy.tokenizer), 256)
    pair = enc(Row("h:1", heldout_rows[0]))
    with torch.no_grad():
        trained = pair_scores(model.eval(), collate_pairs([pair], policy.tokenizer.pad_token_id))
    assert chosen[0] == pytest.approx(float(trained[0]), rel=1e-5, abs=1e-5)
    assert rejected[0] == pytest.approx(float(trained[1]), rel=1e-5, abs=1e-5)


def test_lora_reward_model_resumes_and_exports_a_merged_head(tmp_path, qwen_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    train = write_jsonl(tmp_path / "train.jsonl", carry_pairs(split_problems()[0][:60], 3)[:12])
    common = dict(training={"batch_size": 4, "learning_rate": 5e-3, "epochs": 1},
                  lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}, checkpoint={"every": 1})
    straight = api.train(rm_config(qwen_path, train, tmp_path / "straight", **common))
    # the same run, stopped after step 2 and resumed from its checkpoint
    api.train(rm_config(qwen_path, train, tmp_path / "resumed", **common), ["training.max_steps=2"])
    resumed = api.resume(tmp_path / "resumed", ["training.max_steps=3"])
    assert straight["step"] == resumed["step"] == 3
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)

    final = tmp_path / "straight" / "final"
    base = load_file(Path(qwen_path) / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(a[q], base[q])  # the adapters were merged into the body
    # the adapter folder (with the head in modules_to_save) reproduces the merged export
    merged = AutoModelForSequenceClassification.from_pretrained(final).eval()
    body = AutoModelForSequenceClassification.from_pretrained(qwen_path, num_labels=1)
    adapter = PeftModel.from_pretrained(body, final / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
        assert math.isfinite(float(merged(input_ids=ids).logits[0, 0]))
