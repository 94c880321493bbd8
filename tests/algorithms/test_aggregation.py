"""Loss aggregation: hand cases, a loop oracle, and micro-batch invariance of loss and gradient."""

from __future__ import annotations

import pytest
import torch

from rlft.algorithms.aggregation import AGGREGATIONS, aggregate
from rlft.algorithms.kl import KL_ESTIMATORS
from rlft.algorithms.policy_loss import clipped
from rlft.algorithms.value import clipped_value_loss

F64 = dict(dtype=torch.float64)


def test_hand():
    # rows [1, 2, 3] (3 tokens) and [4] (1 token); padding holds NaN and must not leak
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("nan")]], **F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # token_mean: (1+2+3+4) / 4 = 2.5
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(2.5)
    # sequence_mean: (6/3 + 4/1) / 2 = 3
    assert float(aggregate(x, mask, "sequence_mean")) == pytest.approx(3.0)
    # constant 5: 10 / (2 * 5) = 1
    assert float(aggregate(x, mask, "constant", constant=5)) == pytest.approx(1.0)
    # explicit global normalisers: 10 / 8 = 1.25; (2 + 4) / 4 = 1.5; 10 / (4 * 5) = 0.5
    assert float(aggregate(x, mask, "token_mean", num_tokens=8)) == pytest.approx(1.25)
    assert float(aggregate(x, mask, "sequence_mean", num_sequences=4)) == pytest.approx(1.5)
    assert float(aggregate(x, mask, "constant", num_sequences=4, constant=5)) == pytest.approx(0.5)


def test_empty_rows_and_empty_mask():
    # an empty row contributes 0 and is not counted: sequence_mean = (6/3) / 1 = 2
    x = torch.tensor([[1.0, 2.0, 3.0], [7.0, 7.0, 7.0]], **F64)
    mask = torch.tensor([[True, True, True], [False, False, False]])
    assert float(aggregate(x, mask, "sequence_mean")) == pytest.approx(2.0)
    assert float(aggregate(x, mask, "constant", constant=3)) == pytest.approx(2.0)  # 6 / (1 * 3)
    y = torch.ones(2, 3, requires_grad=True)
    for mode in AGGREGATIONS:
        out = aggregate(y, torch.zeros(2, 3, dtype=torch.bool), mode, constant=4)
        assert float(out.detach()) == 0.0
        out.backward()
        assert torch.equal(y.grad, torch.zeros(2, 3))
        y.grad = None


def test_bad_mode_and_missing_constant():
    x, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_mean, sequence_mean, constant"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="constant > 0"):
        aggregate(x, mask, "constant")


def loop_aggregate(x, mask, mode, constant=None):
    rows = [[float(x[i, t]) for t in range(x.shape[1]) if mask[i, t]] for i in range(x.shape[0])]
    nonempty = [r for r in rows if r]
    if mode == "token_mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "sequence_mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(map(sum, rows)) / (len(nonempty) * constant)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_matches_loop(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 9, generator=g, **F64)
    mask = torch.rand(7, 9, generator=g) > 0.4
    mask[3] = False
    expected = loop_aggregate(x, mask, mode, constant=9)
    assert float(aggregate(x, mask, mode, constant=9)) == pytest.approx(expected, rel=1e-12)


# --- invariance: micro-batches with global normalisers == full batch -------------------------------

SPLITS = ([0, 1, 2], [3], [4, 5, 6, 7, 8], [9])  # uneven micro-batches


def make_batch(seed=1, N=10, T=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[4] = 0  # one empty completion
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logprobs = -torch.rand(N, T, generator=g, **F64) * 3
    old = logprobs + 0.3 * torch.randn(N, T, generator=g, **F64)
    ref = logprobs + 0.5 * torch.randn(N, T, generator=g, **F64)
    adv = torch.randn(N, 1, generator=g, **F64).expand(N, T)
    return logprobs, old, ref, adv, mask


def policy_objective(logprobs, old, ref, adv, mask, mode, num_tokens, num_sequences):
    pg, _ = clipped(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    per_token = pg + 0.04 * KL_ESTIMATORS["k3"](logprobs, ref)  # KL in the loss, as GRPO does
    return aggregate(per_token, mask, mode, num_tokens=num_tokens, num_sequences=num_sequences, constant=12)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_equal_full_batch(mode, dtype, rtol):
    logprobs, old, ref, adv, mask = (t.to(dtype) if t.is_floating_point() else t for t in make_batch())
    num_tokens, num_sequences = float(mask.sum()), float((mask.sum(-1) > 0).sum())

    lp_full = logprobs.clone().requires_grad_()
    full = policy_objective(lp_full, old, ref, adv, mask, mode, num_tokens, num_sequences)
    full.backward()

    lp_micro = logprobs.clone().requires_grad_()
    total = 0.0
    for rows in SPLITS:
        part = policy_objective(lp_micro[rows], old[rows], ref[rows], adv[rows], mask[rows], mode,
                                num_tokens, num_sequences)
        part.backward()  # gradient accumulation
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=rtol, atol=0)
    torch.testing.assert_close(lp_micro.grad, lp_full.grad, rtol=rtol, atol=rtol * float(lp_full.grad.abs().max()))
    assert lp_full.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_local_normalisers_break_equality(mode):
    # Why the global normaliser is needed: per-micro-batch defaults re-weight the samples.
    logprobs, old, ref, adv, mask = make_batch()
    full = policy_objective(logprobs, old, ref, adv, mask, mode, None, None)
    local = sum(policy_objective(logprobs[r], old[r], ref[r], adv[r], mask[r], mode, None, None) for r in SPLITS)
    assert not torch.allclose(local, full, rtol=1e-3)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_value_loss_micro_batches_equal_full_batch(mode):
    g = torch.Generator().manual_seed(2)
    _, _, _, _, mask = make_batch()
    values, old, ret = (torch.randn(*mask.shape, generator=g, **F64) for _ in range(3))
    nt, ns = float(mask.sum()), float((mask.sum(-1) > 0).sum())

    def objective(v, rows):
        loss, _ = clipped_value_loss(v, old[rows], ret[rows], mask[rows], clip=0.2)
        return aggregate(loss, mask[rows], mode, num_tokens=nt, num_sequences=ns, constant=12)

    v_full = values.clone().requires_grad_()
    full = objective(v_full, slice(None))
    full.backward()
    v_micro = values.clone().requires_grad_()
    total = sum(objective(v_micro[r], r) for r in SPLITS)
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-10, atol=0)
    torch.testing.assert_close(v_micro.grad, v_full.grad, rtol=1e-10, atol=1e-14)
