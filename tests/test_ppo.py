"""PPO with a critic (separate model or a value head on the policy) through the same online loop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DIGITS_REWARD
from rlft.api import train
from rlft.models.tiny import build_tiny_model

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD)
    for name, lo, hi in (("train", 0, 16), ("heldout", 100, 116)):
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(lo, hi):
                f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    return root


def ppo_config(root, name, kind="separate", **overrides):
    cfg = {
        "method": "ppo", "output_dir": str(root / name), "seed": 0,
        "model": {"path": str(root / "model")},
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "heldout.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": 8, "num_threads": 1, "lr_scheduler": "constant"},
        "rollout": {"group_size": 4, "prompts_per_step": 8, "max_new_tokens": 12},
        "algorithm": {"kl_coef": 0.001},
        "critic": {"kind": kind},
        "eval": {"temperature": 1.0, "num_samples": 4, "max_new_tokens": 12},
        "rewards": [{"fn": f"{root / 'reward.py'}:digits"}],
        "logging": {"progress": False},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_ppo_raises_held_out_reward_over_its_start(setup, kind):
    from rlft.config import EvalConfig, RewardSpec
    from rlft.eval.run import evaluate_model

    # a fresh critic head is noise: two warm-up steps fit it before the policy moves
    summary = train(ppo_config(setup, f"ppo-{kind}", kind, training={"max_steps": 12},
                               rollout={"group_size": 8, "prompts_per_step": 4}, critic={"warmup_steps": 2}))
    run = setup / f"ppo-{kind}"
    eval_cfg = EvalConfig(temperature=1.0, num_samples=4, max_new_tokens=12)
    reward = [RewardSpec(fn=f"{setup / 'reward.py'}:digits")]
    before = evaluate_model(setup / "model", str(setup / "heldout.jsonl"), reward, eval_cfg).metrics
    assert summary["eval/reward_mean"] > before["eval/reward_mean"] + 0.1, (before, summary)
    metrics = rows(run)
    assert all("value/mse" in r and "value/returns_mean" in r for r in metrics)
    assert metrics[-1]["value/mse"] < metrics[0]["value/mse"] or metrics[0]["value/mse"] < 1e-3
    critic_dir = run / "final" / "critic"
    assert (critic_dir / ("model.safetensors" if kind == "separate" else "value_head.safetensors")).is_file()


# Adam's first steps move every parameter by about the learning rate: a whole separate critic
# overshoots at the rate a lone linear head needs (at 1e-2 both made the batch's MSE worse).
@pytest.mark.parametrize("kind,lr", [("separate", 1e-5), ("shared", 1e-3)])
def test_critic_warmup_trains_only_the_critic(setup, kind, lr, monkeypatch):
    """During critic.warmup_steps the policy's weights stay put while the critic's change, and on
    each warm-up batch the critic's values move toward the returns (their MSE falls). It used to
    check that a fresh head is non-zero (true before any training) and value/mse >= 0 (always).
    A reward offset of 1 puts the returns far from a fresh head's values, so there is a way to go."""
    from rlft.training import critic as critics
    from rlft.training.distributed import SINGLE

    cls = critics.SeparateCritic if kind == "separate" else critics.SharedValueHead
    critic_update, seen = cls.update, []

    def watched_update(self, trainer, batch, generator, policy_trained):
        module = self.model if kind == "separate" else self.head
        mask = self.targets.loss_mask(batch)
        old, returns = self.targets.old_values, self.targets.returns
        critic_before = {k: v.clone() for k, v in module.state_dict().items()}
        policy_before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
        out = critic_update(self, trainer, batch, generator, policy_trained)
        new = self.values(batch, SINGLE)
        mse = [float(((v - returns) ** 2)[mask].mean()) for v in (old, new)]
        seen.append(dict(policy_trained=policy_trained, mse=mse,
                         critic_moved=any(not torch.equal(critic_before[k], v) for k, v in module.state_dict().items()),
                         policy_kept=all(torch.equal(policy_before[k], v)
                                         for k, v in trainer.policy.model.state_dict().items())))
        return out

    monkeypatch.setattr(cls, "update", watched_update)
    (setup / "offset.py").write_text("def offset(prompt, completion, **row):\n    return 1.0\n")
    cfg = ppo_config(setup, f"warmup-{kind}", kind, training={"max_steps": 2, "precision": "fp32", "learning_rate": lr},
                     algorithm={"epochs": 1}, critic={"warmup_steps": 2})
    cfg["rewards"].append({"fn": f"{setup / 'offset.py'}:offset"})
    train(cfg)
    assert len(seen) == 2 and not any(s["policy_trained"] for s in seen)
    assert all(s["policy_kept"] and s["critic_moved"] for s in seen)
    for s in seen:
        assert s["mse"][1] < 0.9 * s["mse"][0], s["mse"]  # values moved toward the returns
    logged = rows(setup / f"warmup-{kind}")
    assert [r["update/optimizer_steps"] for r in logged] == [0.0, 0.0]  # no policy step
    # value/mse is logged from the training forward, before the critic's step: the "before" MSE
    assert [r["value/mse"] for r in logged] == pytest.approx([s["mse"][0] for s in seen], rel=1e-4)
    assert logged[1]["value/mse"] < logged[0]["value/mse"]  # and it falls over the warm-up steps
    before = load_file(str(setup / "model" / "model.safetensors"))
    after = load_file(str(setup / f"warmup-{kind}" / "final" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_ppo_continues_exactly_from_a_checkpoint(setup, kind):
    """4 steps in one go == 2 steps, then continued to 4 from the checkpoint (critic weights,
    critic optimizer and the value head all come back). The shorter run's end-of-run eval samples
    from its own generator, so it does not change what the continued run does."""
    train(ppo_config(setup, f"whole-{kind}", kind, training={"max_steps": 4}))
    train(ppo_config(setup, f"split-{kind}", kind, training={"max_steps": 2}))
    train(ppo_config(setup, f"split-{kind}", kind, training={"max_steps": 4}))
    a, b = setup / f"whole-{kind}", setup / f"split-{kind}"
    for sub in ("model.safetensors", "critic/model.safetensors" if kind == "separate" else "critic/value_head.safetensors"):
        wa, wb = load_file(str(a / "final" / sub)), load_file(str(b / "final" / sub))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), sub
    volatile = ("time", "tokens_per_s")
    strip = [{k: v for k, v in r.items() if not any(t in k for t in volatile) and not k.startswith("eval/")}
             for r in rows(a)]
    strip_b = [{k: v for k, v in r.items() if not any(t in k for t in volatile) and not k.startswith("eval/")}
               for r in rows(b)]
    assert strip == strip_b
