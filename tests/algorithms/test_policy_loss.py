"""The clipped policy loss: hand cases, gradients, a per-token loop oracle, padding safety."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.algorithms.policy_loss import POLICY_LOSSES, clipped

F64 = dict(dtype=torch.float64)


def one(log_ratio, adv, **kw):
    logprobs = torch.tensor([[log_ratio]], **F64, requires_grad=True)
    loss, m = clipped(logprobs, torch.zeros(1, 1, **F64), torch.tensor([[adv]], **F64),
                      torch.ones(1, 1, dtype=torch.bool), **kw)
    loss.sum().backward()
    return float(loss.detach()), float(logprobs.grad), m


def test_registry():
    assert POLICY_LOSSES["clipped"] is clipped


def test_positive_advantage_clipped_high():
    # ratio = e^0.5 = 1.6487, A = +1, clipped to 1.2 -> loss = -min(1.6487, 1.2) = -1.2, no gradient
    loss, grad, m = one(0.5, 1.0)
    assert loss == pytest.approx(-1.2, rel=1e-12)
    assert grad == 0.0
    assert m["clip/high_frac"] == 1.0 and m["clip/low_frac"] == 0.0
    assert m["ratio/mean"] == pytest.approx(math.exp(0.5), rel=1e-12)


def test_negative_advantage_high_ratio_is_not_clipped():
    # ratio 1.6487, A = -1: min(-1.6487, -1.2) = -1.6487 -> loss 1.6487, grad d(-rA)/dlogp = -rA = 1.6487
    loss, grad, m = one(0.5, -1.0)
    assert loss == pytest.approx(math.exp(0.5), rel=1e-12)
    assert grad == pytest.approx(math.exp(0.5), rel=1e-12)
    assert m["clip/high_frac"] == 0.0 and m["clip/low_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage():
    # same token with dual_clip 1.5: loss = min(1.6487, -1.5 * -1) = 1.5, constant -> no gradient
    loss, grad, m = one(0.5, -1.0, dual_clip=1.5)
    assert loss == pytest.approx(1.5, rel=1e-12)
    assert grad == 0.0
    assert m["clip/dual_frac"] == 1.0
    # dual clip never touches A > 0: still -1.2
    assert one(0.5, 1.0, dual_clip=1.5)[0] == pytest.approx(-1.2)
    # below the bound it is inactive: ratio e^0.2 = 1.2214, A = -1 -> loss 1.2214 < 1.5
    loss, _, m = one(0.2, -1.0, dual_clip=1.5)
    assert loss == pytest.approx(math.exp(0.2), rel=1e-12) and m["clip/dual_frac"] == 0.0


def test_negative_advantage_clipped_low():
    # ratio = e^-0.5 = 0.6065 < 0.8, A = -1: min(-0.6065, -0.8) = -0.8 -> loss 0.8, no gradient
    loss, grad, m = one(-0.5, -1.0)
    assert loss == pytest.approx(0.8, rel=1e-12)
    assert grad == 0.0
    assert m["clip/low_frac"] == 1.0


def test_clip_higher():
    # ratio 1.25, A = +2: with clip_high 0.2 -> 1.2 * 2 = 2.4 -> loss -2.4;
    # with DAPO's clip_high 0.28 the ratio is inside (1.25 < 1.28) -> loss -2.5, grad -rA = -2.5
    lr = math.log(1.25)
    assert one(lr, 2.0)[0] == pytest.approx(-2.4, rel=1e-12)
    loss, grad, m = one(lr, 2.0, clip_high=0.28)
    assert loss == pytest.approx(-2.5, rel=1e-12) and grad == pytest.approx(-2.5, rel=1e-12)
    assert m["clip/high_frac"] == 0.0


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        one(0.0, 1.0, dual_clip=1.0)


def test_padding_never_leaks():
    # Garbage (NaN / -inf) logprobs in padding: loss 0 there, finite gradients, metrics over 2 tokens.
    logprobs = torch.tensor([[0.1, float("nan")], [-0.1, float("-inf")]], **F64, requires_grad=True)
    old = torch.tensor([[0.0, float("nan")], [0.0, 0.0]], **F64)
    adv = torch.tensor([[1.0, float("nan")], [-1.0, 5.0]], **F64)
    mask = torch.tensor([[True, False], [True, False]])
    loss, m = clipped(logprobs, old, adv, mask, dual_clip=3.0)
    assert torch.all(loss[~mask] == 0) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all() and torch.all(logprobs.grad[~mask] == 0)
    # ratios e^0.1 = 1.10517, e^-0.1 = 0.90484 -> mean 1.00500
    assert m["ratio/mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2, rel=1e-12)
    assert m["ratio/max"] == pytest.approx(math.exp(0.1)) and m["ratio/min"] == pytest.approx(math.exp(-0.1))
    assert all(math.isfinite(v) for v in m.values())


def test_empty_mask_metrics_are_finite():
    loss, m = clipped(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(loss, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 2.0)])
def test_matches_per_token_loop(clip_low, clip_high, dual_clip):
    g = torch.Generator().manual_seed(0)
    N, T = 5, 8
    logprobs = (-torch.rand(N, T, generator=g, **F64) * 3).requires_grad_()
    old = logprobs.detach() + 0.4 * torch.randn(N, T, generator=g, **F64)
    adv = torch.randn(N, T, generator=g, **F64)
    mask = torch.rand(N, T, generator=g) > 0.25
    loss, m = clipped(logprobs, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss.sum().backward()
    low = high = dual = 0
    ratios = []
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                assert float(loss.detach()[i, t]) == 0.0 and float(logprobs.grad[i, t]) == 0.0
                continue
            r, a = math.exp(float(logprobs.detach()[i, t]) - float(old[i, t])), float(adv[i, t])
            ratios.append(r)
            unclipped, clipped_obj = r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a
            expected = -min(unclipped, clipped_obj)
            grad = -r * a if unclipped <= clipped_obj else 0.0  # d(r)/d(logp) = r
            if dual_clip is not None and a < 0 and expected > -dual_clip * a:
                expected, grad = -dual_clip * a, 0.0
                dual += 1
            low += a < 0 and r < 1 - clip_low
            high += a > 0 and r > 1 + clip_high
            assert float(loss.detach()[i, t]) == pytest.approx(expected, rel=1e-12, abs=1e-14)
            assert float(logprobs.grad[i, t]) == pytest.approx(grad, rel=1e-12, abs=1e-14)
    n = len(ratios)
    assert m["clip/low_frac"] == pytest.approx(low / n) and m["clip/high_frac"] == pytest.approx(high / n)
    assert m["clip/dual_frac"] == pytest.approx(dual / n)
    assert low + high > 0  # the random case does exercise clipping
    assert m["ratio/mean"] == pytest.approx(sum(ratios) / n, rel=1e-12)
    assert m["ratio/max"] == pytest.approx(max(ratios), rel=1e-12)


def test_batch_split_gives_same_per_token_loss():
    # Invariance: each token's loss depends on its own row only, so splitting rows changes nothing.
    g = torch.Generator().manual_seed(1)
    logprobs, old, adv = (torch.randn(6, 5, generator=g, **F64) for _ in range(3))
    mask = torch.rand(6, 5, generator=g) > 0.3
    full, _ = clipped(logprobs, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    parts = [clipped(logprobs[s], old[s], adv[s], mask[s], clip_high=0.28, dual_clip=3.0)[0]
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=0)


def test_approx_kl_is_kl_of_old_to_new_on_tokens_sampled_from_old():
    # log r = log pi - log pi_old = 0.5 on one token: k3 for KL(pi_old || pi) with samples from
    # pi_old is (r - 1) - log r = e^0.5 - 1 - 0.5 = 0.148721 (the other direction's k3,
    # e^-0.5 - 1 + 0.5 = 0.106531, was logged before)
    _, _, m = one(0.5, 1.0)
    assert m["policy/approx_kl"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-12)
    # oracle: its expectation under pi_old is the exact KL(pi_old || pi)
    g = torch.Generator().manual_seed(3)
    old = torch.log_softmax(0.5 * torch.randn(1, 30, generator=g, **F64), -1)  # one distribution, 30 tokens
    new = torch.log_softmax(old + 0.3 * torch.randn(1, 30, generator=g, **F64), -1)
    p_old = old.exp()
    per_token = {}
    for t in range(30):  # every token as "the sampled one"
        _, m = clipped(new[:, t:t + 1], old[:, t:t + 1], torch.ones(1, 1, **F64), torch.ones(1, 1, dtype=torch.bool))
        per_token[t] = m["policy/approx_kl"]
    expected = float((p_old * (old - new)).sum())
    assert sum(float(p_old[0, t]) * v for t, v in per_token.items()) == pytest.approx(expected, rel=1e-9)


def test_truncated_importance_weights_hand_computed():
    from rlft.algorithms.policy_loss import truncated_importance_weights

    trainer = torch.tensor([[-1.0, -1.0, -1.0, -5.0]], **F64)
    engine = torch.tensor([[-1.0, -1.5, -3.0, -1.0]], **F64)
    mask = torch.tensor([[True, True, True, False]])
    w, m = truncated_importance_weights(trainer, engine, mask, cap=2.0)
    # exp(0) = 1; exp(0.5) = 1.6487; exp(2) = 7.389 -> capped at 2; padding -> 1
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), 2.0, 1.0]], **F64))
    assert m["rollout/tis_capped_frac"] == pytest.approx(1 / 3)
    assert m["rollout/tis_weight_mean"] == pytest.approx((1 + math.exp(0.5) + 2) / 3)
    assert not w.requires_grad


def test_tis_scales_the_policy_gradient_term_by_its_weight():
    # one update step as rl_update does it: loss_t = w_t * clipped_t. With ratio 1 (pi = pi_old)
    # and A = 2 the clipped loss is -1 * 2 per token and d/dlogp = -2; TIS multiplies both by w.
    from rlft.algorithms.policy_loss import truncated_importance_weights

    logprobs = torch.tensor([[-1.0, -2.0]], **F64, requires_grad=True)
    engine = torch.tensor([[-1.25, -1.0]], **F64)  # w = exp(0.25) = 1.284, exp(-1) = 0.3679
    mask = torch.ones(1, 2, dtype=torch.bool)
    per_token, _ = clipped(logprobs, logprobs.detach(), torch.full((1, 2), 2.0, **F64), mask)
    w, _ = truncated_importance_weights(logprobs, engine, mask, cap=2.0)
    (per_token * w).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2 * math.exp(0.25), -2 * math.exp(-1.0)]], **F64))
