"""Padding-free forwards: the packed layout by hand, no attention across packed rows, and packed
== padded (values and gradients to 1e-5) for RL completion log-probs, SFT NLL, DPO sequence
log-probs, reward-model scores and a whole policy update."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import take_grads
from rlft.models.forward import completion_logprobs, lm_head, sft_token_nll
from rlft.models.packing import pack_rows
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.contract import Completion
from rlft.training.offline.dpo import sequence_logprobs
from rlft.training.offline.reward_model import pair_scores

# prompts of 2-6 tokens, completions of 1-9: a batch with both left and right padding
PROMPTS = [[5, 9, 31, 7], [12, 40], [3, 3, 8, 100, 101, 102], [60, 61, 62]]
COMPLETIONS = [[44, 61, 2, 17, 90], [8, 11], [70, 71, 72, 73, 74, 75, 76, 77, 78], [9]]


def rollout(prompts=PROMPTS, completions=COMPLETIONS) -> RolloutBatch:
    outs = [Completion(p, c, "", [-1.0] * len(c), "stop", i) for i, (p, c) in enumerate(zip(prompts, completions))]
    return RolloutBatch.from_completions(outs, list(range(len(outs))), 0, torch.device("cpu"))


def right_padded(rows: list[list[int]], answer_from: list[int]) -> dict[str, torch.Tensor]:
    """An SFT/DPO-style batch; tokens from `answer_from[i]` on are targets."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)], target[i, answer_from[i]:len(r)] = torch.tensor(r), 1, True
    return {"input_ids": ids, "attention_mask": mask, "target_mask": target}


SFT_ROWS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23, 24, 25]]
SFT_FROM = [3, 1, 5, 2]


@pytest.fixture(params=["sdpa", "eager"])
def qwen(qwen_path, request):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32,
                                                attn_implementation=request.param).train()


def test_pack_rows_layout_by_hand():
    ids = torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11]])
    mask = (ids > 0).long()
    packed = pack_rows(ids, mask)
    # widest row 6 -> bins of 6: [row 2] and [row 0 | row 1 | 1-token dummy tail]
    assert packed.input_ids.tolist() == [[6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    assert packed.flat_index.tolist() == [[6, 7, 8, -1, -1, -1], [9, 10, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5]]
    single = pack_rows(ids, mask, multi_row=False)  # one sequence of 3 + 2 + 6 tokens
    assert single.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert single.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5]]
    # a rollout row: left-padded prompt, right-padded completion
    left = pack_rows(torch.tensor([[0, 7, 8, 9, 0]]), torch.tensor([[0, 1, 1, 1, 0]]))
    assert left.input_ids.tolist() == [[7, 8, 9]] and left.flat_index.tolist() == [[-1, 0, 1, 2, -1]]
    with pytest.raises(ValueError, match="contiguous"):
        pack_rows(torch.tensor([[1, 0, 2]]), torch.tensor([[1, 0, 1]]))


def test_packed_rows_do_not_attend_to_each_other(qwen):
    batch = rollout()
    assert lm_head(qwen).packing == "multi"
    packed = pack_rows(batch.input_ids, batch.attention_mask)
    shared = packed.flat_index.clamp(min=0) // packed.input_ids.shape[1]  # bin of each token
    assert packed.input_ids.shape[0] < batch.size  # some rows share a bin
    rows_per_bin = [set(r for r in range(batch.size) if int(shared[r].max()) == b) for b in range(packed.input_ids.shape[0])]
    a, b = next(sorted(s) for s in rows_per_bin if len(s) >= 2)[:2]  # two rows in one bin
    with torch.no_grad():
        before, _ = completion_logprobs(qwen, batch.input_ids, batch.attention_mask, batch.completion_len, packing=True)
        changed = batch.input_ids.clone()
        valid = batch.attention_mask[a].bool()
        changed[a, valid] = (changed[a, valid] * 7 + 13) % 500  # every token of row a
        after, _ = completion_logprobs(qwen, changed, batch.attention_mask, batch.completion_len, packing=True)
    cm = batch.completion_mask
    torch.testing.assert_close(after[b][cm[b]], before[b][cm[b]], rtol=0, atol=1e-6)  # row b: unchanged
    assert float((after[a] - before[a])[cm[a]].abs().max()) > 1e-2  # row a itself did change


def _both(fn, model):
    """fn(packing) -> output tensor; returns (padded, packed) outputs and gradients."""
    from rlft.models import forward

    out = {}
    for packing in (False, True):
        value = fn(packing)
        value.backward()
        out[packing] = (value.detach(), take_grads(model))
    # the packed run really packed (the probe did not switch packing off for this model)
    assert (forward._HEADS.get(model) or forward._SCORERS.get(model)) is not None
    used = forward._HEADS[model].packing if model in forward._HEADS else forward._SCORERS[model][2]
    assert used in ("multi", "single")
    return out[False], out[True]


def assert_same(padded, packed):
    (v0, g0), (v1, g1) = padded, packed
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        scale = float(g0[name].abs().max())
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-5 * max(scale, 1e-6), msg=name)


def test_completion_logprobs_packed_equal_padded(qwen):
    batch = rollout()
    cm = batch.completion_mask
    w = torch.linspace(0.1, 1.0, cm.numel()).view_as(cm)
    results = {}

    def loss(packing):
        lp, ent, hidden = completion_logprobs(qwen, batch.input_ids, batch.attention_mask, batch.completion_len,
                                              temperature=0.8, entropy="grad", hidden=True, packing=packing)
        results[packing] = (lp.detach(), ent.detach(), hidden.detach())
        return ((w * lp + 0.3 * w.flip(-1) * ent) * cm).sum() + (hidden.sum(-1) * cm).sum() * 1e-3

    assert_same(*_both(loss, qwen))
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # per token, with zeros on padding


def test_sft_nll_packed_equals_padded(qwen):
    batch = right_padded(SFT_ROWS, SFT_FROM)
    assert_same(*_both(lambda packing: sft_token_nll(qwen, batch["input_ids"], batch["attention_mask"],
                                                     batch["target_mask"], packing), qwen))


def test_dpo_sequence_logprobs_packed_equal_padded(qwen):
    batch = right_padded(SFT_ROWS, SFT_FROM)
    coef = torch.tensor([1.0, -0.5, 0.25, -2.0])  # a margin-like mix of rows

    def value(packing):
        logps, counts = sequence_logprobs(qwen, batch, packing)
        assert counts.tolist() == [4.0, 2.0, 6.0, 2.0]  # 7-3, 3-1, 11-5, 4-2 answer tokens
        return (coef * logps).sum()

    assert_same(*_both(value, qwen))


def test_single_sequence_packing_equals_padded(qwen_path):
    """The layout flash-attention kernels get (all rows in one sequence), checked with sdpa."""
    from transformers import AutoModelForCausalLM

    from rlft.models import forward

    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()
    head = lm_head(model)
    forward._HEADS[model] = forward.LmHead(head.decoder, head.module, head.softcap, head.scale, "single")
    batch = right_padded(SFT_ROWS, SFT_FROM)
    assert_same(*_both(lambda packing: sft_token_nll(model, batch["input_ids"], batch["attention_mask"],
                                                     batch["target_mask"], packing), model))


def test_reward_model_scores_packed_equal_padded(qwen_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(qwen_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = 0
    batch = right_padded(SFT_ROWS, SFT_FROM)
    coef = torch.tensor([1.0, -1.0, 0.5, 2.0])
    assert_same(*_both(lambda packing: (coef * pair_scores(model, batch, packing)).sum(), model))


def test_policy_update_packed_equals_padded(qwen_path):
    """A whole update (clipped loss, k3 KL to a reference, entropy bonus, micro-batches of 2)
    gives the same gradient padded and packed."""
    from transformers import AutoModelForCausalLM

    from rlft.training.online.update import UpdateSettings, policy_update

    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()
    batch = rollout()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(batch.completion_mask).clone()
    ref = torch.full(batch.completion_mask.shape, -6.0)

    class Recorder:
        policy = type("P", (), {"model": model})()

        def __init__(self):
            self.grads = []

        def autocast(self):
            return contextlib.nullcontext()

        def backward(self, loss):
            loss.backward()

        def optimizer_step(self, loss_value):
            self.grads.append(take_grads(model))
            return True, 0.0

    grads = {}
    for packing in (False, True):
        s = UpdateSettings(temperature=1.0, advantage="group_norm", std_floor=1e-4, gamma=1.0, lam=1.0,
                           kl_in_reward=False, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_estimator="k3",
                           kl_in_loss=True, entropy_coef=0.01, loss_agg="token_mean", loss_constant=None, epochs=1,
                           minibatches=1, micro_batch_size=2, mask_truncated=False, packing=packing)
        recorder = Recorder()
        policy_update(recorder, batch, adv, ref, 0.04, s, torch.Generator())
        grads[packing] = recorder.grads[0]
    assert lm_head(model).packing == "multi"
    assert_same((torch.zeros(()), grads[False]), (torch.zeros(()), grads[True]))


def test_a_model_that_mixes_packed_rows_is_not_packed(qwen_path, monkeypatch, caplog):
    """If packed rows would see each other (here: positions that do not restart, so transformers
    sees one long sequence), the first-use probe switches packing off and says so."""
    from transformers import AutoModelForCausalLM

    from rlft.models import forward

    real = forward.pack_rows

    def no_restart(input_ids, attention_mask, multi_row=True, pad_id=0):
        packed = real(input_ids, attention_mask, multi_row, pad_id)
        width = packed.position_ids.shape[1]
        packed.position_ids = torch.arange(width).expand_as(packed.position_ids).clone()
        return packed

    monkeypatch.setattr(forward, "pack_rows", no_restart)
    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32)
    with caplog.at_level("WARNING"):
        assert lm_head(model).packing is None
    assert "packed rows attend to each other" in caplog.text
    batch = right_padded(SFT_ROWS, SFT_FROM)
    with torch.no_grad():
        a = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"], packing=False)
        b = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"], packing=True)
    assert float(a) == float(b)  # packing=True ran the padded forward
