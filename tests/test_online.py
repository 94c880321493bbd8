"""End to end on the tiny model: the online loop learns, respects its invariants and fails clearly."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlft.api import train
from rlft.config import load_config
from rlft.errors import ConfigError, DataError, TrainingHalted
from rlft.models.tiny import build_tiny_model

REWARDS = '''
def digits(prompt, completion, **row):
    """Share of digit characters: dense, so a few GRPO steps move it."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

def constant(prompt, completion, **row):
    return 0.5

def flaky(prompt, completion, **row):
    return None if len(completion) % 2 else 1.0

def half_flat(prompt, completion, answer, **row):
    """Even prompts: the same reward for every completion (a zero-variance group)."""
    return 1.0 if int(answer) % 2 == 0 else digits(prompt, completion)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    build_tiny_model(root / "model", seed=0)
    (root / "rewards.py").write_text(REWARDS)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Count to {i}.", "answer": str(i)}) + "\n")
    return root


def _config(setup, name, reward="digits", **sections):
    cfg = {
        "method": "grpo", "output_dir": str(setup / "runs" / name), "seed": 0,
        "model": {"path": str(setup / "model")}, "data": {"train": str(setup / "prompts.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": 8, "num_threads": 1, "lr_scheduler": "constant"},
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12},
        "rewards": [{"fn": f"{setup / 'rewards.py'}:{reward}"}],
        "logging": {"progress": False, "sample_every": 4},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_grpo_raises_reward_changes_parameters_and_logs_everything(setup):
    cfg = _config(setup, "grpo")
    summary = train(cfg)
    run = setup / "runs" / "grpo"
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    first = sum(r["reward/mean"] for r in rows[:2]) / 2
    last = sum(r["reward/mean"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)
    assert rows[-1]["kl"] > 0  # beta = 0.04 (grpo preset) > 0
    before, after = _weights(setup / "model"), _weights(run / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    required = ["reward/mean", "reward/std", "reward/digits", "reward/infra_error_rate", "adv/zero_std_group_frac",
                "kl", "entropy", "completion/length_mean", "completion/length_max", "completion/truncation_rate",
                "clip/low_frac", "clip/high_frac", "ratio/mean", "ratio/max", "grad_norm", "lr", "beta",
                "tokens_per_s", "time/generate", "time/score", "time/train"]
    assert not [k for k in required if k not in rows[0]]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {4, 8} and all("reward" in s and "completion" in s for s in samples)
    assert summary["status"] == "completed" and (run / "final" / "rlft_template.json").is_file()


@pytest.mark.parametrize("method", ["gspo", "cispo"])
def test_sequence_and_weight_clipped_presets_raise_reward(setup, method):
    """GSPO and CISPO learn the digits task as GRPO does (same 8 steps, same bar)."""
    cfg = _config(setup, f"learn-{method}")
    cfg["method"] = method
    assert train(cfg)["status"] == "completed"
    rows = _metrics(setup / "runs" / f"learn-{method}")
    first = sum(r["reward/mean"] for r in rows[:2]) / 2
    last = sum(r["reward/mean"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)


def test_all_equal_rewards_without_kl_leave_parameters_unchanged(setup):
    cfg = _config(setup, "flat", reward="constant", algorithm={"kl_coef": 0.0, "entropy_coef": 0.0},
                  training={"max_steps": 3})
    train(cfg)
    rows = _metrics(setup / "runs" / "flat")
    assert all(r["adv/zero_std_group_frac"] == 1.0 for r in rows)
    before, after = _weights(setup / "model"), _weights(setup / "runs" / "flat" / "final")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_entropy_bonus_moves_parameters_even_with_flat_rewards(setup):
    """The counterpart of the test above: the no-signal shortcut must not skip a real loss term."""
    cfg = _config(setup, "entropy", reward="constant", algorithm={"kl_coef": 0.0, "entropy_coef": 0.01},
                  training={"max_steps": 1})
    train(cfg)
    before, after = _weights(setup / "model"), _weights(setup / "runs" / "entropy" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)


class _GradRecorder:
    """Stands in for the training session: records the gradient of each update instead of stepping."""

    def __init__(self, policy):
        self.policy, self.grads = policy, []

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self, loss_value):
        self.grads.append({n: p.grad.clone() for n, p in self.policy.model.named_parameters() if p.grad is not None})
        self.policy.model.zero_grad(set_to_none=True)
        return True, 0.0


def _tiny_batch(setup, **sampling):
    """The tiny policy, 4 prompts x 8 sampled completions as a batch, and group-norm advantages of
    a reward (text length mod 3) that varies within every group."""
    from rlft.algorithms import ADVANTAGE_ESTIMATORS
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.models.template import encode_prompt, end_of_turn_ids
    from rlft.rollout.contract import SamplingParams
    from rlft.rollout.batch import RolloutBatch
    from rlft.rollout.hf import HFEngine
    from rlft.training.online.update import token_rewards

    policy = load_policy(ModelConfig(path=str(setup / "model")), LoraConfig())
    engine = HFEngine(policy.model, policy.tokenizer, end_of_turn_ids(policy.tokenizer), policy.device, seed=0)
    prompts = [encode_prompt(policy.tokenizer, [{"role": "user", "content": f"Count to {i}."}]) for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(n=8, **sampling))
    batch = RolloutBatch.from_completions(outs, [o.prompt_index for o in outs], policy.tokenizer.pad_token_id,
                                          policy.device)
    rewards = [float(len(o.text) % 3) for o in outs]
    adv, _ = ADVANTAGE_ESTIMATORS["group_norm"](token_rewards(rewards, batch, None), batch.completion_mask,
                                                batch.group_ids, torch.ones(len(outs), dtype=torch.bool))
    return policy, batch, adv


def test_micro_batches_give_the_same_gradient(setup):
    """One update over 32 completions, in one forward or in micro-batches of 5 (sorted by length,
    re-padded): the same gradient, because every part divides by the global normaliser."""
    from rlft.training.online.update import UpdateSettings, policy_update

    policy, batch, adv = _tiny_batch(setup, max_new_tokens=12)
    grads = []
    for micro in (None, 5):
        for agg in ("token_mean", "sequence_mean", "constant"):
            cfg = load_config(_config(setup, "unused", algorithm={"micro_batch_size": micro, "loss_agg": agg,
                                                                  "entropy_coef": 0.01}))
            recorder = _GradRecorder(policy)
            policy_update(recorder, batch, adv, None, 0.0, UpdateSettings.from_config(cfg), torch.Generator())
            grads.append(recorder.grads[0])
    for full, split in zip(grads[:3], grads[3:]):
        assert full.keys() == split.keys() and full
        for name in full:
            # relative to the tensor's scale: the micro-batches sum ~300 tokens in another float32 order
            scale = float(full[name].abs().max())
            torch.testing.assert_close(split[name], full[name], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("policy_loss", ["clipped", "gspo", "cispo"])
def test_mu_epochs_and_minibatches(setup, policy_loss):
    cfg = _config(setup, f"mu-{policy_loss}", training={"max_steps": 2},
                  algorithm={"epochs": 2, "minibatches": 2, "policy_loss": policy_loss})
    train(cfg)
    rows = _metrics(setup / "runs" / f"mu-{policy_loss}")
    assert all(r["update/optimizer_steps"] == 4.0 for r in rows)
    # after the first minibatch step the policy has moved: the importance ratio (a sequence's under
    # gspo) leaves 1
    assert max(r["ratio/max"] for r in rows) > 1.0 + 1e-6


# What each preset stands for (config.py's PRESETS cite the papers), written out here so a changed
# preset fails this test instead of being read back from itself. rollout.max_new_tokens is 12.
PRESET_PROMISES = {
    "dr_grpo": dict(advantage="group_mean", loss_agg="constant", loss_constant=12, kl_coef=0.0, clip_low=0.2,
                    clip_high=0.2, dynamic_sampling=False),
    "dapo": dict(advantage="group_norm", loss_agg="token_mean", kl_coef=0.0, clip_low=0.2, clip_high=0.28,
                 dynamic_sampling=True),
    "rloo": dict(advantage="rloo", loss_agg="token_mean", kl_coef=0.05, kl_in="reward", kl_estimator="k1",
                 clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
    "reinforce_pp": dict(advantage="reinforce_pp", loss_agg="token_mean", kl_coef=0.01, kl_in="reward",
                         kl_estimator="k1", clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
    # GSPO (arXiv:2507.18071): sequence ratio and clip, the paper's ranges, per-sequence mean
    "gspo": dict(policy_loss="gspo", advantage="group_norm", loss_agg="sequence_mean", clip_low=3e-4,
                 clip_high=4e-4, dual_clip=None),
    # CISPO (arXiv:2506.13585): no lower bound on the weight, upper bound 1 + 3
    "cispo": dict(policy_loss="cispo", advantage="group_norm", loss_agg="token_mean", clip_low=1.0, clip_high=3.0),
}


@pytest.mark.parametrize("method", list(PRESET_PROMISES))
def test_presets_train(setup, method, monkeypatch):
    """Each preset resolves to the algorithm it promises, takes one real optimizer step per rollout
    step (counted at the session, not read from a metric) with a non-zero gradient, and moves the
    weights. (It used to check only grad_norm > 0 over rows filtered by `update/optimizer_steps`:
    a run with no optimizer step passed.) With the KL in the reward (rloo, reinforce_pp), the
    token rewards the advantage estimator sees are the sequence reward minus beta x k1 against the
    starting weights, and the logged `kl` is the mean of that k1."""
    from rlft.training.online import loop as online
    from rlft.training.session import TrainingSession

    steps, seen = [], []
    session_step = TrainingSession.optimizer_step

    def counted_step(self, loss_value):
        applied, norm = session_step(self, loss_value)
        steps.append((applied, norm))
        return applied, norm

    def recorded_token_rewards(rewards, batch, kl_penalty):
        out = online_token_rewards(rewards, batch, kl_penalty)
        seen.append((list(rewards), batch, None if kl_penalty is None else kl_penalty.clone(), out.clone()))
        return out

    online_token_rewards = online.token_rewards
    monkeypatch.setattr(TrainingSession, "optimizer_step", counted_step)
    monkeypatch.setattr(online, "token_rewards", recorded_token_rewards)
    cfg = _config(setup, method, training={"max_steps": 2, "precision": "fp32"})
    cfg["method"] = method
    summary = train(cfg)
    assert summary["status"] == "completed"
    run = setup / "runs" / method
    resolved = load_config(run / "config.yaml").algorithm  # what the run used
    assert {k: getattr(resolved, k) for k in PRESET_PROMISES[method]} == PRESET_PROMISES[method]

    rows = _metrics(run)
    assert len(rows) == 2 and [r["update/optimizer_steps"] for r in rows] == [1.0, 1.0]
    assert len(steps) == 2 and all(applied and norm > 0 for applied, norm in steps)
    assert [r["grad_norm"] for r in rows] == pytest.approx([norm for _, norm in steps], rel=1e-6)
    before, after = _weights(setup / "model"), _weights(run / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)

    assert len(seen) == 2
    if resolved.kl_in != "reward":
        assert all(penalty is None for _, _, penalty, _ in seen)
        return
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.training.online.update import batch_logprobs

    start = load_policy(ModelConfig(path=str(setup / "model"), dtype="fp32"), LoraConfig()).model  # the reference
    for row, (rewards, batch, penalty, token_rewards) in zip(rows, seen):
        mask = batch.completion_mask
        k1 = torch.where(mask, batch.sampling_logprobs - batch_logprobs(start, batch, 1.0, None), 0.0)  # [N, T]
        torch.testing.assert_close(penalty.where(mask, 0.0), row["beta"] * k1, rtol=1e-4, atol=1e-7)
        assert row["kl"] == pytest.approx(float(k1.sum() / mask.sum()), rel=1e-4, abs=1e-7)
        # what the update sees: each sequence reward on its last token, beta x k1 taken off every token
        expected = -row["beta"] * k1
        last = mask.sum(-1) - 1
        expected[torch.arange(batch.size), last] += torch.tensor(rewards)
        torch.testing.assert_close(token_rewards, expected.float(), rtol=1e-4, atol=1e-6)
    assert rows[0]["beta"] == resolved.kl_coef
    assert float((seen[1][2].abs() * seen[1][1].completion_mask).max()) > 1e-4  # step 2: the policy has moved


def test_unverifiable_rewards_are_counted_and_stop_the_run(setup):
    cfg = _config(setup, "flaky", reward="flaky", training={"max_steps": 2}, scoring={"max_infra_error_rate": 1.0})
    train(cfg)
    rows = _metrics(setup / "runs" / "flaky")
    assert all(0 < r["reward/infra_error_rate"] < 1 for r in rows)
    strict = _config(setup, "flaky-strict", reward="flaky", scoring={"max_infra_error_rate": 0.05})
    with pytest.raises(TrainingHalted, match="could not be computed"):
        train(strict)


def test_group_size_one_is_a_config_error(setup):
    with pytest.raises(ConfigError, match="group_size"):
        load_config(_config(setup, "g1", rollout={"group_size": 1}))


def test_dapo_dynamic_sampling_drops_and_refills_flat_groups(setup):
    cfg = _config(setup, "dapo-dyn", reward="half_flat", training={"max_steps": 2})
    cfg["method"] = "dapo"
    train(cfg)
    rows = _metrics(setup / "runs" / "dapo-dyn")
    assert all(r["dynamic_sampling/dropped_groups"] >= 1 for r in rows)
    assert all(r["dynamic_sampling/rounds"] >= 2 for r in rows)
    assert all(r["dynamic_sampling/kept_groups"] <= 4 for r in rows)
    # only groups with reward variance are trained on
    assert all(r["adv/zero_std_group_frac"] < 1.0 for r in rows)
    # the reward of everything sampled is logged too: the dropped even prompts all scored 1.0
    assert all(r["dynamic_sampling/reward_mean_before_filter"] > r["reward/mean"] for r in rows)


def test_adaptive_kl_raises_beta_when_kl_is_above_target(setup):
    cfg = _config(setup, "akl", training={"max_steps": 4}, algorithm={"kl_coef": 0.04, "kl_target": 1e-6})
    train(cfg)
    rows = _metrics(setup / "runs" / "akl")
    # step 1 measures KL 0 (policy == reference): below 0.5 x target, beta / 1.5; afterwards the
    # policy has moved, KL > 1.5 x target, beta x 1.5 per step. Replay the rule on the logged KLs.
    beta = 0.04
    for row in rows:
        assert row["beta"] == pytest.approx(beta)
        beta = beta * 1.5 if row["kl"] > 1.5e-6 else beta / 1.5 if row["kl"] < 0.5e-6 else beta
    assert rows[-1]["beta"] > rows[1]["beta"]


def test_proportional_kl_controller_steps_beta_by_the_sequences_seen(setup):
    """kl_controller=proportional reaches the loop with its horizon and the global batch's sequence
    count (4 prompts x 8 = 32): replay Ziegler et al.'s rule on the logged KLs."""
    cfg = _config(setup, "pkl", training={"max_steps": 3, "precision": "fp32"},
                  algorithm={"kl_coef": 0.04, "kl_target": 1e-3, "kl_controller": "proportional", "kl_horizon": 100})
    train(cfg)
    rows = _metrics(setup / "runs" / "pkl")
    beta = 0.04
    for row in rows:
        assert row["beta"] == pytest.approx(beta, rel=1e-9)
        beta *= 1 + max(-0.2, min(0.2, row["kl"] / 1e-3 - 1)) * 32 / 100  # at most x/÷ 1.064 a step
    assert len({round(r["beta"], 12) for r in rows}) == 3  # it moved every step


def test_mask_truncated_removes_cut_completions_from_the_loss(setup):
    """max_new_tokens=2: every completion is cut, so masking leaves no signal and the run's update
    is skipped, weights unchanged. The precondition is asserted: the test used to check only `if`
    every completion was cut, and with seed 0 one of 32 stopped, so it checked nothing. Seed 1
    cuts all 32; the mixed case is the gradient test below."""
    cfg = _config(setup, "mask-trunc", training={"max_steps": 1}, rollout={"max_new_tokens": 2},
                  algorithm={"mask_truncated": True, "kl_coef": 0.0})
    cfg["seed"] = 1
    train(cfg)
    row = _metrics(setup / "runs" / "mask-trunc")[0]
    assert row["completion/truncation_rate"] == 1.0, "precondition: every completion cut (try another seed)"
    assert row["update/skipped_no_signal"] == 1.0 and row["update/optimizer_steps"] == 0.0
    before, after = _weights(setup / "model"), _weights(setup / "runs" / "mask-trunc" / "final")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_mask_truncated_gradient_is_that_of_the_uncut_rows_alone(setup):
    """On a batch with cut and uncut completions (a stop string ends some early): the masked update's
    gradient equals the unmasked gradient of the uncut rows alone (their tokens are the normaliser),
    and differs from the unmasked gradient of the whole batch, so the cut rows did count before."""
    from rlft.training.online.update import UpdateSettings, policy_update

    policy, batch, adv = _tiny_batch(setup, max_new_tokens=8, stop=("a",))
    cut = batch.truncated
    assert 0 < int(cut.sum()) < batch.size  # mixed rows (22 stopped, 10 cut for seed 0)
    assert (adv[cut] != 0).any() and (adv[~cut] != 0).any()  # both kinds carry signal

    def grad(rows, mask_truncated):
        cfg = load_config(_config(setup, "unused", training={"precision": "fp32"},
                                  algorithm={"mask_truncated": mask_truncated, "kl_coef": 0.0}))
        recorder = _GradRecorder(policy)
        policy_update(recorder, batch.select(rows), adv[rows], None, 0.0, UpdateSettings.from_config(cfg),
                      torch.Generator())
        return recorder.grads[0]

    everything = torch.arange(batch.size)
    masked, uncut_only, unmasked = grad(everything, True), grad(everything[~cut], False), grad(everything, False)
    assert masked.keys() == uncut_only.keys() and masked
    for name in masked:
        scale = float(uncut_only[name].abs().max())
        torch.testing.assert_close(masked[name], uncut_only[name], rtol=1e-5, atol=1e-6 * scale)
    differs = [name for name in masked if not torch.allclose(masked[name], unmasked[name], rtol=1e-2, atol=1e-6)]
    assert len(differs) > len(masked) // 2


def test_eval_command_writes_pass_at_k_next_to_the_run(setup):
    import subprocess
    import sys
    from pathlib import Path

    run = setup / "runs" / "grpo"
    if not (run / "final").is_dir():
        train(_config(setup, "grpo", training={"max_steps": 1}))
    rlft = Path(sys.executable).parent / "rlft"
    out = subprocess.run([str(rlft), "eval", str(run), "--data", str(setup / "prompts.jsonl"),
                          "--reward", f"{setup / 'rewards.py'}:digits", "--samples", "4", "--temperature", "1.0",
                          "--max-new-tokens", "8", "--out", str(setup / "eval.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    saved = json.loads((run / "evals" / "prompts.json").read_text())["metrics"]
    assert 0.0 <= saved["eval/pass@1"] <= saved["eval/pass@4"] <= 1.0
    assert len((setup / "eval.jsonl").read_text().splitlines()) == 16 * 4


@pytest.mark.parametrize("reward, shown", [(1.158409321308136, "reward 1.16"), (None, "reward unverifiable")])
def test_sample_lines_show_model_text_verbatim(reward, shown):
    # a completion is model output: "[/]" or "[bold]" in it must print as text, not as console markup
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from rlft.rewards.scores import Scores
    from rlft.training.online.loop import _log_samples

    out = io.StringIO()
    console = Console(file=out, width=400)
    logged = []
    session = SimpleNamespace(step=10, log_samples=logged.extend, print=console.print)
    rollout = SimpleNamespace(
        completions=[SimpleNamespace(text="see [/] and [bold]x[/bold]", finish_reason="stop")],
        examples=[SimpleNamespace(where="train.jsonl:3", prompt_text="What is [1+1]?")],
        rewards=[reward], scores=Scores([reward], {"correct": [reward]}))
    _log_samples(session, rollout, num_samples=1, every=5)
    text = out.getvalue()
    assert shown in text and "see [/] and [bold]x[/bold]" in text and "What is [1+1]?" in text
    assert logged[0]["reward"] == reward and logged[0]["completion"] == "see [/] and [bold]x[/bold]"


def test_prompt_rows_are_checked_before_training_with_the_fields_the_rewards_need(setup, tmp_path):
    # one bad row per defect class; `answer` is needed by the math reward (built-in, field=answer)
    # and `hint` by a user function whose parameter has no default
    (tmp_path / "needs.py").write_text("def uses_hint(prompt, completion, hint, finish_reason, *, scale, **row):\n"
                                      "    return 0.0\n")
    lines = [json.dumps({"prompt": "What is 1 + 1?", "answer": "2", "hint": "h"}),
             '{"prompt": "What is 2 + 2?", "answer": ',                                    # 2: bad JSON
             json.dumps({"question": "What is 3 + 3?", "answer": "6", "hint": "h"}),       # 3: no prompt
             json.dumps({"prompt": 44, "answer": "8", "hint": "h"}),                       # 4: wrong type
             json.dumps({"prompt": "   ", "answer": "0", "hint": "h"}),                    # 5: empty prompt
             json.dumps({"prompt": "What is 5 + 5?", "hint": "h"}),                        # 6: no answer
             json.dumps({"prompt": "What is 6 + 6?", "answer": "12"}),                     # 7: no hint
             json.dumps({"prompt": "add " * 200, "answer": "1", "hint": "h"}),             # 8: too long
             json.dumps({"prompt": [{"role": "user"}], "answer": "1", "hint": "h"}),       # 9: malformed turns
             json.dumps({"prompt": "What is 9 + 9?", "answer": "18", "hint": "h"})]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = _config(setup, "bad-prompts", data={"train": str(data), "max_prompt_length": 64})
    cfg["rewards"] = [{"fn": "math"}, {"fn": f"{tmp_path / 'needs.py'}:uses_hint", "args": {"scale": 2.0}}]
    with pytest.raises(DataError) as info:
        train(cfg)
    message = str(info.value)
    assert f"{data}: 8 of 10 prompt rows are invalid" in message
    expected = {2: "bad JSON", 3: "missing field 'prompt'", 4: "wrong type for 'prompt'", 5: "empty 'prompt'",
                6: "missing field 'answer'", 7: "missing field 'hint'", 8: "prompt longer than data.max_prompt_length",
                9: "malformed 'prompt'"}
    for line, reason in expected.items():
        assert reason in message and f"{data}:{line}" in message, (line, reason, message)
    assert f"{data}:1\n" not in message and f"{data}:10" not in message
    assert "data.on_invalid=drop" in message
    assert not (setup / "runs" / "bad-prompts" / "metrics.jsonl").exists()  # nothing trained


def test_required_fields_of_rewards():
    from rlft.config import RewardSpec
    from rlft.rewards.scoring import RewardScorer

    scorer = RewardScorer([RewardSpec(fn="math"), RewardSpec(fn="exact_match", args={"field": "gold"}),
                           RewardSpec(fn="code"), RewardSpec(fn="regex", args={"pattern": "x"}),
                           RewardSpec(fn="json_fields", args={"field": "expected"}),
                           RewardSpec(fn="json_fields", name="jf2", args={"required": ["a"], "field": "expected"})])
    assert scorer.required_fields == ("answer", "gold", "tests", "expected")


def _first_row(setup, name, **sections):
    train(_config(setup, name, **sections))
    return _metrics(setup / "runs" / name)[0]


def test_on_policy_ratio_is_exactly_one_with_lora_dropout_configured(setup):
    # LoRA dropout 0.05 would make the training forward differ from the dropout-free rollout
    # (ratio 0.85-1.20 at step 0): dropout is off in online methods, pi_old is the trainer's own
    # forward, and the engine's log-probs agree with it to float precision.
    # (LoRA's B starts at zero, so dropout shows from the second step on.)
    # fp32: the engine/trainer agreement bound (1e-4) is float32 rounding; tests/test_bf16.py has
    # the bf16-mixed bound
    train(_config(setup, "lora-dropout", training={"max_steps": 3, "learning_rate": 1e-2, "precision": "fp32"},
                  lora={"enabled": True, "dropout": 0.05}, algorithm={"kl_coef": 0.0}))
    rows = _metrics(setup / "runs" / "lora-dropout")
    assert len(rows) == 3
    for row in rows:
        assert row["ratio/mean"] == 1.0 and row["ratio/max"] == 1.0 and row["ratio/min"] == 1.0
        assert row["clip/high_frac"] == 0.0 and row["clip/low_frac"] == 0.0
        assert row["rollout/logprob_diff_max"] < 1e-4
        assert row["rollout/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_drift_is_read_before_any_update_and_warns_only_on_engine_mismatch(setup, monkeypatch, capsys):
    import rlft.training.online.loop as online

    # mu = 2 epochs x 2 minibatches: later minibatches see a moved policy (intended drift)
    row = _first_row(setup, "drift-mu", training={"max_steps": 1}, algorithm={"epochs": 2, "minibatches": 2})
    assert row["ratio/max"] > 1.0 + 1e-4
    assert row["rollout/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert "off-policy" not in capsys.readouterr().err

    # an engine whose log-probs are 0.5 lower than the trainer's: pi_trainer / pi_engine = e^0.5
    real = online.rollout_engine

    def skewed(cfg, policy, seed, dtype=None):
        engine = real(cfg, policy, seed, dtype)
        generate = engine.generate

        def shifted(prompts, params, first_prompt=0):
            out = generate(prompts, params, first_prompt)
            for c in out:
                c.logprobs = [lp - 0.5 for lp in c.logprobs]
            return out

        engine.generate = shifted
        return engine

    monkeypatch.setattr(online, "rollout_engine", skewed)
    row = _first_row(setup, "drift-engine", training={"max_steps": 1},
                     algorithm={"rollout_correction": "tis", "tis_cap": 1.5})
    assert row["rollout/ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-3)
    assert row["rollout/logprob_diff_mean"] == pytest.approx(0.5, abs=1e-3)
    assert row["rollout/tis_weight_mean"] == pytest.approx(1.5) and row["rollout/tis_capped_frac"] == 1.0
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "ratio_drift at step 1: rollout/ratio_mean 1.649 is above 1.3: training is off-policy" in err
    events = [json.loads(line) for line in (setup / "runs" / "drift-engine" / "events.jsonl").read_text().splitlines()]
    assert [e["detector"] for e in events if e["detector"] == "ratio_drift"] == ["ratio_drift"]


def test_no_reference_model_is_built_when_no_kl_term_uses_it(setup, monkeypatch):
    import rlft.training.online.loop as online

    def refuse(policy):
        raise AssertionError("a reference model was built for a run without a KL term")

    monkeypatch.setattr(online, "Reference", refuse)
    cfg = _config(setup, "dapo-noref", training={"max_steps": 1})
    cfg["method"] = "dapo"
    assert train(cfg)["status"] == "completed"


def test_rewards_see_the_whole_conversation_and_the_rendered_prompt(setup, tmp_path):
    from rlft.models.loading import load_tokenizer
    from rlft.config import ModelConfig
    from rlft.models.template import render

    (tmp_path / "spy.py").write_text(
        "import json\n"
        f"LOG = {str(tmp_path / 'seen.jsonl')!r}\n"
        "def spy(prompt, completion, messages, rendered_prompt, **row):\n"
        "    with open(LOG, 'a') as f:\n"
        "        f.write(json.dumps({'prompt': prompt, 'messages': messages, 'rendered': rendered_prompt}) + '\\n')\n"
        "    return float(len(completion) % 2)\n")
    conversation = [{"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "Count to 3."},
                    {"role": "assistant", "content": "un deux trois"},
                    {"role": "user", "content": "Now to 4."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": conversation}) + "\n")
    cfg = _config(setup, "conversation", training={"max_steps": 1}, data={"train": str(tmp_path / "chat.jsonl")},
                  rollout={"prompts_per_step": 1, "group_size": 2})
    cfg["rewards"] = [{"fn": f"{tmp_path / 'spy.py'}:spy"}]
    train(cfg)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    tok = load_tokenizer(ModelConfig(path=str(setup / "model")))
    assert len(seen) == 2 and all(s["prompt"] == "Now to 4." for s in seen)
    assert all(s["messages"] == conversation for s in seen)
    assert all(s["rendered"] == render(tok, conversation, add_generation_prompt=True) for s in seen)
    assert "Answer in French." in seen[0]["rendered"]
