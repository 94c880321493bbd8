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
    from rlft.training.online import critic as critics
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


@pytest.mark.parametrize("kind", ["separate", pytest.param("shared", marks=pytest.mark.slow)])
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


def test_gae_and_value_targets_run_over_model_tokens_only_across_the_tool_gap():
    """Tool tokens are not actions: GAE steps from one sampled token to the next sampled one, so
    the return crosses an observation as if it were absent (value.py); advantages, returns and the
    value loss's gradient are exactly 0 on tool tokens and padding. The values there (9, 7) are
    garbage on purpose: using them would change every number below."""
    from rlft.config import CriticConfig, load_config
    from rlft.rollout.batch import RolloutBatch
    from rlft.rollout.contract import Completion
    from rlft.training.online.critic import _ValueTargets
    from rlft.training.online.update import UpdateSettings, token_rewards

    settings = UpdateSettings.from_config(load_config({
        "method": "ppo", "output_dir": "/tmp/unused", "model": {"path": "x"}, "data": {"train": "x"},
        "rewards": [{"fn": "math"}]}))
    # row 0: sampled, sampled, tool, tool, sampled; row 1: one turn of 3 tokens, then padding
    comps = [Completion([5], [10, 11, 12, 13, 14], "", [-1.0] * 5, "stop", 0, loss_mask=[1, 1, 0, 0, 1]),
             Completion([5], [10, 11, 12], "", [-1.0] * 3, "stop", 0)]
    batch = RolloutBatch.from_completions(comps, [0, 0], 0, torch.device("cpu"))
    mask = batch.completion_mask
    rewards = token_rewards([1.0, 0.5], batch, None)  # on each row's last sampled token: columns 4 and 2
    values = torch.tensor([[0.5, 0.25, 9.0, 9.0, 0.75], [0.5, 0.25, 0.125, 7.0, 7.0]])
    targets = _ValueTargets(CriticConfig(whiten_advantages=False), settings, 0.5, 0.5, 1e-4)
    adv, _ = targets.gae_advantages(values, mask, batch.group_ids, rewards, torch.ones(2, dtype=torch.bool), (0, 2))
    # gamma = lam = 0.5. Row 0 over its sampled tokens (V 0.5, 0.25, 0.75; r 0, 0, 1):
    #   A4 = 1 - 0.75 = 0.25;  A1 = (0.5*0.75 - 0.25) + 0.25*0.25 = 0.1875
    #   A0 = (0.5*0.25 - 0.5) + 0.25*0.1875 = -0.328125;  returns = A + V = 0.171875, 0.4375, 1.0
    # Row 1 (V 0.5, 0.25, 0.125; r 0, 0, 0.5):
    #   A2 = 0.5 - 0.125 = 0.375;  A1 = (0.0625 - 0.25) + 0.25*0.375 = -0.09375
    #   A0 = (0.125 - 0.5) + 0.25*(-0.09375) = -0.3984375;  returns = 0.1015625, 0.15625, 0.5
    assert adv.tolist() == [[-0.328125, 0.1875, 0, 0, 0.25], [-0.3984375, -0.09375, 0.375, 0, 0]]
    assert targets.returns.tolist() == [[0.171875, 0.4375, 0, 0, 1.0], [0.1015625, 0.15625, 0.5, 0, 0]]
    # oracle: the same episode with the tool tokens cut out gives the same numbers on its tokens
    packed = RolloutBatch.from_completions([Completion([5], [10, 11, 14], "", [-1.0] * 3, "stop", 0)], [0], 0,
                                           torch.device("cpu"))
    packed_adv, _ = _ValueTargets(CriticConfig(whiten_advantages=False), settings, 0.5, 0.5, 1e-4).gae_advantages(
        values[:1, [0, 1, 4]], packed.completion_mask, packed.group_ids, token_rewards([1.0], packed, None),
        torch.ones(1, dtype=torch.bool), (0, 1))
    assert packed_adv[0].tolist() == adv[0, [0, 1, 4]].tolist()
    # gamma = lam = 1: every sampled token's return is the episode's reward, A = reward - V
    targets_1 = _ValueTargets(CriticConfig(whiten_advantages=False), settings, 1.0, 1.0, 1e-4)
    adv_1, _ = targets_1.gae_advantages(values, mask, batch.group_ids, rewards, torch.ones(2, dtype=torch.bool),
                                        (0, 2))
    assert adv_1[0].tolist() == [0.5, 0.75, 0, 0, 0.25] and targets_1.returns[0].tolist() == [1.0, 1.0, 0, 0, 1.0]
    # the value loss: no gradient reaches the values of tool tokens or padding
    fitted = values.clone().requires_grad_()
    loss, _ = targets.value_loss(fitted, torch.arange(2), mask, float(mask.sum()))
    loss.backward()
    assert torch.equal(fitted.grad[~mask], torch.zeros(int((~mask).sum())))
    assert (fitted.grad[mask] != 0).all()


@pytest.mark.parametrize("kind,lr", [("separate", 1e-5), ("shared", 1e-3)])  # rates as in the warm-up test
def test_ppo_trains_on_agent_episodes_with_tool_tokens(setup, kind, lr, monkeypatch):
    """PPO through the online loop on two-turn episodes (a calculator call, its result, an answer;
    scripted, since a tiny random model almost never writes a valid call): the batch GAE sees has
    a hole where the tool result sits, returns there are 0, the policy's weights move and the
    critic fits the (repeating) returns."""
    from rlft.rollout.agent.tool_calls import hermes
    from rlft.rollout.agent.tools import load_tools
    from rlft.rollout.agent.turns import AgentLimits, TurnDriver
    from rlft.training.online import critic as critics
    from test_agents import ScriptedEngine, call_text

    steps = 3
    script = [call_text("calculator", {"expression": "6*7"}), "It is 42."] * steps  # two engine calls per step

    def scripted_driver(cfg, engine, tokenizer, *_):  # (seed, max_prompt_tokens): unused by the script
        return TurnDriver(ScriptedEngine(tokenizer, script), tokenizer, load_tools(cfg.tools), hermes,
                          AgentLimits(max_total_tokens=cfg.max_total_tokens))

    seen = []
    real_gae = critics._ValueTargets.gae_advantages

    def watched_gae(self, values, mask, *args):
        out = real_gae(self, values, mask, *args)
        seen.append((mask.clone(), self.returns.clone()))
        return out

    import rlft.rollout.agent.build as agent_build

    monkeypatch.setattr(agent_build, "turn_driver", scripted_driver)  # the one agent_driver builds (evaluations too)
    monkeypatch.setattr(critics._ValueTargets, "gae_advantages", watched_gae)
    # no KL in the reward: the scripted log-probs are made up, so the returns are the reward alone
    cfg = ppo_config(setup, f"agent-{kind}", kind, algorithm={"kl_coef": 0.0},
                     training={"max_steps": steps, "precision": "fp32", "learning_rate": lr},
                     rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 200},
                     agent={"tools": ["calculator"], "max_total_tokens": 400})
    cfg["data"].pop("eval")
    assert train(cfg)["status"] == "completed"
    assert len(seen) == steps
    for mask, returns in seen:
        for row in mask:  # tool tokens between the first sampled token and the last: a hole
            sampled = row.nonzero().squeeze(-1)
            assert not row[sampled[0]:sampled[-1]].all()
        assert torch.equal(returns[~mask], torch.zeros(int((~mask).sum())))
    logged = rows(setup / f"agent-{kind}")
    assert all(r["agent/turns_mean"] == 2.0 and r["agent/tool_token_frac"] > 0 for r in logged)
    assert all(r["update/optimizer_steps"] > 0 for r in logged)
    assert logged[-1]["value/mse"] < logged[0]["value/mse"], [r["value/mse"] for r in logged]
    before = load_file(str(setup / "model" / "model.safetensors"))
    after = load_file(str(setup / f"agent-{kind}" / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
