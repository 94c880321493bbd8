"""Each prompt once per group (`training.shared_prefix`): the layout by hand, the cost model's
choice by hand, and shared == plain (log-probs, entropies, hidden states, values and every
gradient, full and LoRA, to 1e-5 in fp32) on eager and sdpa, with prompts of different lengths,
groups split over micro-batches, the model's full-logits path and a separate critic. Two ranks:
tests/test_distributed.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import take_grads
from rlft.models import forward
from rlft.models.forward import completion_logprobs, lm_head
from rlft.models.shared_prefix import AttentionCost, SharedRows, _KINDS, share_prefixes
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.contract import Completion

# three groups of three: prompts of 4, 2 and 6 tokens, completions of 1-9 tokens
PROMPTS = [[5, 9, 31, 7], [12, 40], [3, 3, 8, 100, 101, 102]]
COMPLETIONS = [[[44, 61, 2, 17, 90], [8, 11], [70, 71, 72]],
               [[9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34]],
               [[20, 21, 22, 23], [60], [90, 91, 92, 93, 94, 95]]]


def rollout() -> RolloutBatch:
    outs, groups = [], []
    for g, (p, comps) in enumerate(zip(PROMPTS, COMPLETIONS)):
        for c in comps:
            outs.append(Completion(p, c, "", [-1.0] * len(c), "stop", g))
            groups.append(g)
    return RolloutBatch.from_completions(outs, groups, 0, torch.device("cpu"))


@pytest.fixture(params=["sdpa", "eager"])
def qwen(qwen_path, request):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32,
                                                attn_implementation=request.param).train()


def lora(model):
    from rlft.config import LoraConfig
    from rlft.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # peft starts B at 0; make the adapters matter
    return model


def assert_same_grads(plain: dict, shared: dict) -> None:
    assert plain.keys() == shared.keys() and plain
    for name in plain:
        scale = float(plain[name].abs().max())
        torch.testing.assert_close(shared[name], plain[name], rtol=1e-5, atol=1e-5 * max(scale, 1e-6), msg=name)


def test_layout_by_hand():
    # prompt A = [1, 2] with completions [3, 4] and [5]; prompt B = [6, 7, 8] with [9, 10]
    ids = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 5, 0], [6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    rows = share_prefixes(ids, mask, prompt_width=3)
    # segments [A | 3 4 | 5] and [B | 9 10], 5 tokens each: one bin each
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4]]  # [5] sits at position 2, as in its row
    assert rows.part.tolist() == [[0, 0, 1, 1, 2], [0, 0, 0, 1, 1]]
    # row 1's prompt tokens are row 0's: one copy
    assert rows.flat_index.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 1, 4, -1], [5, 6, 7, 8, 9]]
    assert rows.shared_rows == 1
    allowed = rows.attention_mask("bool")[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],   # prompt: causal
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],   # [3 4]: the prompt and itself
                       [1, 1, 1, 1, 0],
                       [1, 1, 0, 0, 1]]   # [5]: the prompt and itself, not [3 4]
    additive = rows.attention_mask("additive")[0, 0]
    assert bool((additive == 0).eq(torch.tensor(allowed).bool()).all())
    assert float(additive.min()) == torch.finfo(torch.float32).min
    # no prompt shared by two rows: no layout (the plain one is used)
    assert share_prefixes(ids[1:], mask[1:], prompt_width=3) is None


def test_the_cost_model_shares_long_prompts_and_keeps_long_completions_apart():
    cost = AttentionCost(token=1.0, pair=0.01)
    # prompt 100, four completions of 10: one segment of 140 costs 140 + 0.01 * 140^2 = 336; alone
    # 4 x (110 + 121) = 924; pairs 2 x (120 + 144) = 528 -> one segment
    assert [len(rows) for rows in _segments(cost, prompt=100, completion=10)] == [4]
    # prompt 10, four completions of 100: alone 924; pairs 2 x (210 + 441) = 1302; one 410 + 1681 =
    # 2091 -> each alone, which is the plain layout: None
    ids, mask = _group(10, 100)
    assert share_prefixes(ids, mask, 10, cost) is None
    assert share_prefixes(ids, mask, 10, None).shared_rows == 3  # 'on': one segment whatever it costs


def _group(prompt: int, completion: int, rows: int = 4):
    ids = torch.arange(1, prompt + completion + 1).repeat(rows, 1)
    return ids, torch.ones_like(ids)


def _segments(cost, prompt, completion):
    ids, mask = _group(prompt, completion)
    rows = share_prefixes(ids, mask, prompt, cost)
    return [sorted(set(int(i) for i in rows.part[b] if i > 0)) for b in range(rows.input_ids.shape[0])]


def _outputs(model, batch, mode, weights):
    """(log-probs, entropy, hidden states) with the mode's forward, and the gradients of a loss
    that mixes all three."""
    lp, ent, hidden = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                          temperature=0.8, entropy="grad", hidden=True, packing=True,
                                          shared_prefix=mode)
    cm = batch.completion_mask
    loss = ((weights * lp + 0.3 * weights.flip(-1) * ent) * cm).sum() + (hidden.sum(-1) * cm).sum() * 1e-3
    loss.backward()
    return (lp.detach(), ent.detach(), hidden.detach()), take_grads(model)


def _compare_modes(model, modes=("on", "auto")):
    batch = rollout()
    w = torch.linspace(0.1, 1.0, batch.completion_mask.numel()).view_as(batch.completion_mask)
    plain = _outputs(model, batch, "off", w)
    for mode in modes:
        shared = _outputs(model, batch, mode, w)
        for a, b in zip(plain[0], shared[0]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # per token, zeros on padding
        assert_same_grads(plain[1], shared[1])
    return plain[1]


def test_shared_equals_plain_full_model(qwen):
    _compare_modes(qwen)
    head = lm_head(qwen)
    assert _KINDS[head.decoder] == ("additive" if qwen.config._attn_implementation == "eager" else "bool")
    batch = rollout()
    p = batch.input_ids.shape[1] - batch.completion_len
    cost = AttentionCost.of(qwen.config)
    assert share_prefixes(batch.input_ids, batch.attention_mask, p, cost).shared_rows == 6  # 'auto' shared too


def test_shared_equals_plain_lora(qwen):
    grads = _compare_modes(lora(qwen))
    assert all("lora_" in n for n in grads)


def test_shared_equals_plain_on_the_models_full_logits(qwen_path):
    """The path for a model whose head rlft does not split off (and for FSDP-sharded models)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()
    forward._HEADS[model] = None  # as for an unknown head
    _compare_modes(model, modes=("on",))
    assert _KINDS[model] == "bool"


def test_a_model_that_ignores_the_mask_keeps_the_plain_layout(qwen_path, monkeypatch, caplog):
    """A probe failure (here: a mask that lets completions see each other) leaves the plain path."""
    from transformers import AutoModelForCausalLM

    real = SharedRows.attention_mask
    monkeypatch.setattr(SharedRows, "attention_mask",
                        lambda self, kind, dtype=torch.float32: real(self, kind, dtype) | (self.segment[:, None, :, None]
                                                                                           >= 0))
    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32)
    batch = rollout()
    with caplog.at_level("WARNING"), torch.no_grad():
        on, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                    shared_prefix="on")
        off, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_len)
    assert _KINDS[lm_head(model).decoder] is None
    assert "not honoured" in caplog.text
    assert torch.equal(on, off)  # the plain forward ran


def _settings(mode, **changes):
    from rlft.training.online.update import UpdateSettings

    base = dict(temperature=1.0, advantage="group_norm", std_floor=1e-4, gamma=1.0, lam=1.0, kl_in_reward=False,
                clip_low=0.2, clip_high=0.2, dual_clip=None, kl_estimator="k3", kl_in_loss=True, entropy_coef=0.01,
                loss_agg="token_mean", loss_constant=None, epochs=1, minibatches=1, micro_batch_size=2,
                mask_truncated=False, packing=True, shared_prefix=mode)
    return UpdateSettings(**{**base, **changes})


class Recorder:
    """A trainer that records each optimizer step's gradients instead of stepping."""

    def __init__(self, model):
        self.policy = type("P", (), {"model": model})()
        self.grads = []

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self, loss_value):
        self.grads.append(take_grads(self.policy.model))
        return True, 0.0


@pytest.mark.parametrize("adapters", [False, True])
def test_policy_update_and_reference_shared_equal_plain(qwen_path, adapters):
    """A whole update (clipped loss, k3 KL, entropy bonus) in micro-batches of 2 rows: groups of 3
    split over micro-batches; two epochs (old log-probs from a no-grad pass, as the reference's)."""
    from transformers import AutoModelForCausalLM

    from rlft.training.online.update import batch_logprobs, policy_update

    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()
    model = lora(model) if adapters else model
    batch = rollout()
    adv = torch.linspace(-1.0, 1.0, batch.size)[:, None].expand_as(batch.completion_mask).clone()
    ref = torch.full(batch.completion_mask.shape, -6.0)
    grads, refs = {}, {}
    for mode in ("off", "on"):
        s = _settings(mode, epochs=2)
        with torch.no_grad():
            refs[mode] = batch_logprobs(model, batch, 1.0, 4, packing=True, shared_prefix=mode)
        recorder = Recorder(model)
        policy_update(recorder, batch, adv, ref, 0.04, s, torch.Generator())
        grads[mode] = recorder.grads
    torch.testing.assert_close(refs["on"], refs["off"], rtol=1e-5, atol=1e-5)
    assert len(grads["on"]) == len(grads["off"]) == 2
    for plain, shared in zip(grads["off"], grads["on"]):
        assert_same_grads(plain, shared)
    assert _KINDS[lm_head(model).decoder] == "bool"


def test_separate_critic_values_and_gradients_shared_equal_plain(qwen_path, tmp_path):
    from rlft.config import load_config
    from rlft.training.online.critic import SeparateCritic

    config = load_config({"method": "ppo", "output_dir": str(tmp_path), "model": {"path": str(qwen_path)},
                          "data": {"train": str(tmp_path / "unused.jsonl")}, "critic": {"kind": "separate"},
                          "training": {"precision": "fp32"}, "rewards": [{"fn": "length"}]})
    batch = rollout()
    mask = batch.completion_mask
    out = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)  # the same fresh score head
        critic = SeparateCritic(config, torch.device("cpu"), 0, _settings(mode), total_steps=1)
        critic.model.train()
        values = critic._values(batch)  # [N, T]
        (values * torch.linspace(-1.0, 1.0, mask.numel()).view_as(mask) * mask).sum().backward()
        out[mode] = (values.detach(), take_grads(critic.model))
    torch.testing.assert_close(out["on"][0][mask], out["off"][0][mask], rtol=1e-5, atol=1e-5)
    assert_same_grads(out["off"][1], out["on"][1])
    assert _KINDS[critic.model] == "bool"
