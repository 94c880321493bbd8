"""DPO: sequence log-probs against a per-row oracle, gradient accumulation, the LoRA reference,
the precomputed reference, learning a held-out preference on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import big_and_micro_batches, make_config, take_grads, write_jsonl
from rlft import api
from rlft.config import DataConfig, DpoConfig, ModelConfig, load_config
from rlft.demo.arithmetic import preference_rows, split_problems
from rlft.data.readers import Row
from rlft.data.pairs import collate_pairs, make_preference_encoder
from rlft.errors import ConfigError
from rlft.models.loading import LoadedModel, Reference, load_policy, load_tokenizer
from rlft.models.template import end_of_turn_ids
from rlft.training.offline.dpo import DpoObjective, sequence_logprobs
from rlft.training.offline.loop import make_objective, run_offline


def varied_pairs(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic pairs whose prompts and answers differ in length, so batches carry padding."""
    rows = preference_rows(split_problems(seed)[0][:3 * n], seed)[:n]
    for i, r in enumerate(rows):
        r["prompt"] += " Show the steps." * (i % 3)
        r["chosen"] += " Done." * (i % 2)
    return rows


def encode_pairs(tok, rows):
    enc = make_preference_encoder(tok, end_of_turn_ids(tok), max_length=256)
    return [enc(Row(f"pairs.jsonl:{i + 1}", r)) for i, r in enumerate(rows)]


def dpo_config(model_path, train, out, **sections):
    config = make_config(model_path, train, out, **sections)
    config["method"] = "dpo"
    return config




@pytest.fixture(scope="module")
def tok(qwen_path):
    return load_tokenizer(ModelConfig(path=str(qwen_path)))


@pytest.fixture(scope="module")
def model64(qwen_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_path).double().train()


def _objective(tok, model, **dpo):
    """The objective without a session: live reference = a frozen copy of `model` as it is now."""
    objective = DpoObjective(DataConfig(train="unused.jsonl"), DpoConfig(**dpo), chunk=4)
    objective.pad_id = tok.pad_token_id
    objective.reference = Reference(LoadedModel(model, tok, torch.device("cpu"), False))
    return objective


# -- sequence log-probs -----------------------------------------------------------------------

def test_sequence_logprobs_match_an_unpadded_per_row_oracle(tok, model64):
    examples = encode_pairs(tok, varied_pairs(4, seed=1))
    batch = collate_pairs(examples, tok.pad_token_id)
    with torch.no_grad():
        logps, counts = sequence_logprobs(model64, batch)  # [8]
    sides = [e.chosen for e in examples] + [e.rejected for e in examples]
    assert len({len(s.input_ids) for s in sides}) >= 3  # padded rows really differ
    for i, side in enumerate(sides):
        ids = torch.tensor([side.input_ids])
        with torch.no_grad():
            token_logps = F.log_softmax(model64(input_ids=ids).logits[0, :-1], -1)  # [T-1, V]
        picked = token_logps.gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(side.target_mask[1:], dtype=torch.bool)
        # float32 log-softmax inside (selected_logprobs upcasts to float32, not to float64)
        assert float(logps[i]) == pytest.approx(float(picked[mask].sum()), rel=1e-5)
        assert float(counts[i]) == side.answer_tokens


# -- normalisation ----------------------------------------------------------------------------

def test_micro_batches_give_the_big_batch_gradient(tok, model64):
    examples = encode_pairs(tok, varied_pairs(8, seed=2))
    objective = _objective(tok, model64, nll_coef=0.3)
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy off the reference, away from the loss's symmetric point
        for p in model64.parameters():
            p.add_(0.01 * torch.randn_like(p))
    norm = objective.normaliser(examples)
    assert norm == 8.0  # pairs in the step

    run = big_and_micro_batches(objective, model64, examples, norm)
    big, micro, m_big, m_micro = run.grads_big, run.grads_micro, run.metrics_big, run.metrics_micro

    assert run.loss_micro == pytest.approx(run.loss_big, rel=1e-6)
    for key in ("rewards/margin", "rewards/accuracy", "logps/chosen", "nll/chosen", "tokens"):
        # log-probs are summed in float32 (about -200 each), so margins agree to ~1e-5 absolute
        assert m_micro[key] == pytest.approx(m_big[key], rel=1e-6, abs=1e-4), key
    assert big.keys() == micro.keys() and len(big) > 0
    # The weights are float64 but log-softmax runs in float32 (selected_logprobs), so the two
    # gradients differ by float32 rounding: ~4e-7 of each tensor's norm, against > 1e-2 for the
    # control below.
    scale = max(float(g.abs().max()) for g in big.values())
    for name in big:
        torch.testing.assert_close(micro[name], big[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
        assert float((micro[name] - big[name]).norm()) <= 1e-5 * float(big[name].norm()), name

    # Control: a mean over each micro-batch (normaliser = its own pair count) is a different gradient.
    for i in range(0, 8, 2):
        loss, _ = objective.loss(model64, examples[i:i + 2], 2.0)
        loss.backward()
    wrong = take_grads(model64)
    rel = max(float((wrong[n] - big[n]).norm() / big[n].norm()) for n in big if big[n].norm() > 0)
    assert rel > 1e-2


def test_nll_term_is_the_chosen_answers_mean_token_nll(tok, model64):
    examples = encode_pairs(tok, varied_pairs(4, seed=3))
    base = _objective(tok, model64)
    with_nll = _objective(tok, model64, nll_coef=0.5)
    with torch.no_grad():
        plain, _ = base.loss(model64, examples, 4.0)
        mixed, metrics = with_nll.loss(model64, examples, 4.0)
        logps, counts = sequence_logprobs(model64, collate_pairs(examples, tok.pad_token_id))
    nll = float((-logps[:4] / counts[:4]).mean())  # per token, then per pair
    assert nll > 5.0  # a random model: about ln(512) = 6.2 per token
    assert float(mixed - plain) == pytest.approx(0.5 * nll, rel=1e-6)
    assert metrics["nll/chosen"] == pytest.approx(nll, rel=1e-6)


def test_ipo_regresses_the_per_token_log_ratio_margin(tok, model64):
    # IPO's target 1/(2 beta) = 5 is on the scale of per-token log-probs (arXiv:2310.12036; TRL
    # averages too); with summed log-probs of long answers the margin would dwarf it.
    import copy

    examples = encode_pairs(tok, varied_pairs(4, seed=7))
    ipo = _objective(tok, copy.deepcopy(model64), loss="ipo")  # reference = the model before the nudge
    policy = copy.deepcopy(model64)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.01 * torch.randn_like(param))
        batch = collate_pairs(examples, tok.pad_token_id)
        pol, counts = sequence_logprobs(policy, batch)  # summed over answer tokens  # [8]
        ref, _ = sequence_logprobs(model64, batch)
        loss, _ = ipo.loss(policy, examples, 4.0)
    mean_pol, mean_ref = pol / counts, ref / counts
    h = (mean_pol[:4] - mean_ref[:4]) - (mean_pol[4:] - mean_ref[4:])  # per-token margin  # [4]
    expected = float(((h - 1 / (2 * 0.1)) ** 2).mean())  # beta 0.1: target 5
    assert float(loss) == pytest.approx(expected, rel=1e-9)
    h_summed = (pol[:4] - ref[:4]) - (pol[4:] - ref[4:])
    assert float(((h_summed - 5) ** 2).mean()) != pytest.approx(expected, rel=1e-3)  # the answers differ in length


def test_accumulated_run_equals_unbatched_run(tmp_path, qwen_path):
    train = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(16, seed=4))

    def run(out, micro):
        config = load_config(dpo_config(qwen_path, train, tmp_path / out, data={"max_length": 256}, training={
            "batch_size": 8, "micro_batch_size": micro, "learning_rate": 1e-3, "adam_eps": 1e-4,
            "precision": "fp32"}))  # compares float64 weights to 1e-5: no autocast
        policy = load_policy(config.model, config.lora)
        policy.model.double()
        initial = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        return run_offline(config, policy=policy), initial, dict(policy.model.named_parameters())

    # Log-softmax runs in float32 (selected_logprobs), so gradients agree to ~4e-7 relative. At
    # step 1 the policy is the reference and the chosen/rejected gradients nearly cancel in many
    # weights; Adam with a tiny eps would turn that float32 noise into full-size (lr) steps of
    # random sign. adam_eps = 1e-4 keeps such near-zero gradients near-zero updates.
    s_big, initial, big = run("big", None)
    s_micro, _, micro = run("micro", 2)
    assert s_big["step"] == s_micro["step"] == 2
    assert max(float((big[n].detach() - initial[n]).abs().max()) for n in big) > 1e-3
    for name in big:
        torch.testing.assert_close(micro[name].detach(), big[name].detach(), rtol=1e-5, atol=1e-7, msg=name)
    assert s_micro["train/loss"] == pytest.approx(s_big["train/loss"], rel=1e-5)


# -- reference --------------------------------------------------------------------------------

def test_lora_reference_is_the_policy_without_adapters(tmp_path, qwen_path):
    train = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(8, seed=5))
    config = dpo_config(qwen_path, train, tmp_path / "run", data={"max_length": 256},
                        training={"batch_size": 4, "learning_rate": 1e-2},
                        lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0})
    summary = api.train(config)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = records[0], records[1]
    # LoRA's B starts at zero: at step 0 the policy IS the reference, h = 0 for every pair and the
    # sigmoid loss is -log sigmoid(0) = log 2 exactly
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["rewards/margin"] == 0.0 and first["rewards/accuracy"] == 0.0
    assert first["rewards/chosen"] == 0.0 and first["grad_norm"] > 0
    assert second["rewards/margin"] != 0.0  # after one update the adapters moved the policy
    final = tmp_path / "run" / "final"
    assert (final / "adapter" / "adapter_config.json").is_file() and (final / "model.safetensors").is_file()
    assert summary["status"] == "completed"


def test_precomputed_reference_equals_the_live_one(tmp_path, qwen_path):
    rows = varied_pairs(6, seed=6)
    train = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = load_config(dpo_config(qwen_path, train, tmp_path / "run", data={"max_length": 256},
                                    training={"batch_size": 4}, dpo={"precompute_ref": True}))
    policy = load_policy(config.model, config.lora)
    objective = make_objective(config)
    examples = objective.prepare(policy)[0].examples
    assert objective.reference is None  # the frozen copy is dropped once every pair is scored
    with torch.no_grad():
        live, _ = sequence_logprobs(policy.model, collate_pairs(examples, policy.tokenizer.pad_token_id))
    stored = torch.tensor([e.ref_chosen_logp for e in examples] + [e.ref_rejected_logp for e in examples],
                          dtype=torch.float64)
    torch.testing.assert_close(stored, live.double(), rtol=1e-5, atol=1e-4)
    # and the loss at step 0 is log 2 up to the float noise of a different batch shape
    loss, _ = objective.loss(policy.model, examples, float(len(examples)))
    assert float(loss.detach()) == pytest.approx(math.log(2), abs=1e-4)


def test_label_smoothing_needs_the_sigmoid_loss(tmp_path, qwen_path):
    with pytest.raises(ConfigError, match="dpo.label_smoothing applies to the sigmoid loss only"):
        load_config(dpo_config(qwen_path, "x.jsonl", tmp_path, dpo={"loss": "ipo", "label_smoothing": 0.1}))


# -- learning ---------------------------------------------------------------------------------

def test_dpo_raises_held_out_preference_accuracy_and_margin(tmp_path, qwen_path):
    # Pairs "carry stated and added" vs "carry stated, then forgotten" on disjoint problems. A
    # random-init model learns this one quickly; the example config trains on all three slips.
    train_problems, heldout_problems = split_problems(seed=0, heldout=200)
    kinds = ("forgot_carry",)
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(train_problems[:200], 1, kinds))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", preference_rows(heldout_problems[:100], 2, kinds))
    config = load_config(dpo_config(qwen_path, train, tmp_path / "run", data={"eval": str(heldout)},
                                    training={"batch_size": 8, "max_steps": 8, "learning_rate": 3e-3}))
    policy = load_policy(config.model, config.lora)
    start = make_objective(config)
    _, evals, _ = start.prepare(policy)
    before = start.evaluate(policy, evals)
    # the policy is the reference: every implicit reward is 0, every pair a tie
    assert before["eval/rewards/margin"] == 0.0 and before["eval/rewards/accuracy"] == 0.0
    assert before["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)

    summary = run_offline(config, policy=policy)
    assert summary["eval/rewards/accuracy"] >= 0.9
    assert summary["eval/rewards/margin"] > 0.5
    assert summary["eval/loss"] < 0.5 * math.log(2)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["eval/rewards/accuracy"] == summary["eval/rewards/accuracy"]
    assert saved["data/train/pairs"] == len(train.read_text().splitlines())
    assert saved["data/train/duplicate_pairs"] == 0
    # the export is an ordinary causal LM: the next stage (e.g. GRPO) starts from it
    reloaded = load_policy(ModelConfig(path=str(tmp_path / "run" / "final")), config.lora)
    assert type(reloaded.model).__name__ == "Qwen2ForCausalLM"
