"""GSPO, GSPO-token and CISPO: hand cases with the arithmetic written out, a gradient oracle
(GSPO-token with a constant advantage per sequence equals GSPO), and padding safety."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.algorithms import aggregate
from rlft.algorithms.policy_loss import POLICY_LOSSES, cispo, clipped, gspo, gspo_token

F64 = dict(dtype=torch.float64)


def test_registered_by_name():
    assert POLICY_LOSSES["gspo"] is gspo and POLICY_LOSSES["gspo_token"] is gspo_token
    assert POLICY_LOSSES["cispo"] is cispo


def _grad(fn, logprobs, old, adv, mask, agg="sequence_mean", **kw):
    lp = logprobs.clone().requires_grad_(True)
    per_token, metrics = fn(lp, old, adv, mask, **kw)
    loss = aggregate(per_token, mask, agg)
    loss.backward()
    return float(loss.detach()), lp.grad, metrics


def test_gspo_sequence_ratio_hand_case():
    # one sequence of 2 tokens, log ratios 0.3 and -0.1: s = exp((0.3 - 0.1) / 2) = e^0.1 = 1.10517.
    # A = +1 and clip_high 0.2 -> inside [0.8, 1.2]: loss = -s = -1.10517 (sequence mean).
    # d(-s)/d logp_t = -s / |y| = -0.55259 for each token.
    old = torch.zeros(1, 2, **F64)
    loss, grad, m = _grad(gspo, torch.tensor([[0.3, -0.1]], **F64), old, torch.ones(1, 2, **F64),
                          torch.ones(1, 2, dtype=torch.bool), clip_low=0.2, clip_high=0.2)
    s = math.exp(0.1)
    assert loss == pytest.approx(-s, rel=1e-12)
    torch.testing.assert_close(grad, torch.full((1, 2), -s / 2, **F64), rtol=1e-12, atol=0)
    assert m["ratio/mean"] == pytest.approx(s, rel=1e-12) and m["clip/high_frac"] == 0.0
    # the paper's tiny range clips the same sequence: s = 1.105 > 1 + 4e-4, A > 0 -> loss -(1 + 4e-4), no gradient
    loss, grad, m = _grad(gspo, torch.tensor([[0.3, -0.1]], **F64), old, torch.ones(1, 2, **F64),
                          torch.ones(1, 2, dtype=torch.bool))
    assert loss == pytest.approx(-(1 + 4e-4), rel=1e-12) and float(grad.abs().max()) == 0.0
    assert m["clip/high_frac"] == 1.0


def test_gspo_is_a_sequence_level_clip_where_ppo_clips_tokens():
    # log ratios +0.5 and -0.5: token ratios 1.65 / 0.61 leave PPO's [0.8, 1.2] (the first token,
    # A > 0, is clipped and loses its gradient) but their geometric mean is exactly 1: GSPO keeps
    # the whole sequence, and both tokens get gradient -A / |y| * s = -0.5.
    lp, old = torch.tensor([[0.5, -0.5]], **F64), torch.zeros(1, 2, **F64)
    adv, mask = torch.ones(1, 2, **F64), torch.ones(1, 2, dtype=torch.bool)
    _, grad_gspo, _ = _grad(gspo, lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(grad_gspo, torch.tensor([[-0.5, -0.5]], **F64), rtol=1e-12, atol=0)
    _, grad_ppo, _ = _grad(clipped, lp, old, adv, mask, agg="token_mean")
    assert float(grad_ppo[0, 0]) == 0.0 and float(grad_ppo[0, 1]) != 0.0


def test_gspo_token_with_constant_advantages_equals_gspo():
    """The paper's claim (section 4.3), as an oracle: GSPO-token's gradient is GSPO's when every token
    of a sequence has the sequence's advantage; rows of different lengths, padding holding garbage."""
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=gen, **F64) * 0.05
    old = lp + torch.randn(4, 6, generator=gen, **F64) * 0.05
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 1 + [0] * 5], dtype=torch.bool)
    lp = lp.where(mask, torch.tensor(float("nan"), **F64))  # padding: never read
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], **F64)[:, None].expand(4, 6).contiguous()
    for low, high in ((0.2, 0.2), (3e-4, 4e-4)):
        loss_s, grad_s, _ = _grad(gspo, lp, old, adv, mask, clip_low=low, clip_high=high)
        loss_t, grad_t, _ = _grad(gspo_token, lp, old, adv, mask, clip_low=low, clip_high=high)
        assert loss_t == pytest.approx(loss_s, rel=1e-12)
        torch.testing.assert_close(grad_t.where(mask, 0.0), grad_s.where(mask, 0.0), rtol=1e-10, atol=1e-14)
        assert not torch.isnan(grad_t.where(mask, 0.0)).any()


def test_gspo_token_per_token_advantages():
    # s = exp((0.2 + 0.0) / 2) = e^0.1 = 1.10517 on both tokens, clip [0.8, 1.2] inactive;
    # A = (+1, -2): loss_t = -s A_t -> (-1.10517, 2.21034), sequence mean = (sum) / 2 = 0.55259;
    # d/d logp_t = -s A_t / 2 (the token's own log-prob only) = (-0.55259, 1.10517)
    lp, old = torch.tensor([[0.2, 0.0]], **F64), torch.zeros(1, 2, **F64)
    adv, mask = torch.tensor([[1.0, -2.0]], **F64), torch.ones(1, 2, dtype=torch.bool)
    loss, grad, _ = _grad(gspo_token, lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s = math.exp(0.1)
    assert loss == pytest.approx(s / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-s / 2, s]], **F64), rtol=1e-12, atol=0)


def test_cispo_weight_is_clipped_but_the_gradient_survives():
    # log ratio 0.5: r = 1.6487; clip_high 0.2 caps the weight at 1.2, A = +1.
    # loss = -1.2 * A * logp = -1.2 * 0.5 = -0.6; gradient -1.2 (PPO's clip gives 0 here)
    lp, old = torch.tensor([[0.5]], **F64), torch.zeros(1, 1, **F64)
    adv, mask = torch.ones(1, 1, **F64), torch.ones(1, 1, dtype=torch.bool)
    loss, grad, m = _grad(cispo, lp, old, adv, mask, agg="token_mean", clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-0.6, rel=1e-12)
    assert float(grad) == pytest.approx(-1.2, rel=1e-12)
    assert m["clip/high_frac"] == 1.0
    assert float(_grad(clipped, lp, old, adv, mask, agg="token_mean")[1]) == 0.0
    # inside the range the weight is the ratio: r = e^0.1, A = -2 -> gradient -r * A = 2 e^0.1
    _, grad, m = _grad(cispo, torch.tensor([[0.1]], **F64), old, -2 * adv, mask, agg="token_mean",
                       clip_low=0.2, clip_high=0.2)
    assert float(grad) == pytest.approx(2 * math.exp(0.1), rel=1e-12) and m["clip/high_frac"] == 0.0
    # the paper's form, no lower bound (clip_low = 1): r = e^-3 = 0.0498 stays the weight
    _, grad, _ = _grad(cispo, torch.tensor([[-3.0]], **F64), old, adv, mask, agg="token_mean", clip_low=1.0)
    assert float(grad) == pytest.approx(-math.exp(-3.0), rel=1e-12)


def test_on_policy_every_loss_has_the_vanilla_policy_gradient():
    """At pi = pi_old (the single-pass case) every loss's gradient is -A / normaliser on each token."""
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 5, generator=gen, **F64)
    mask = torch.tensor([[1] * 5, [1] * 2 + [0] * 3, [1] * 4 + [0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.1, 0.4], **F64)[:, None].expand(3, 5).contiguous()
    lengths = mask.sum(-1, keepdim=True).to(torch.float64)
    expected = torch.where(mask, -adv / lengths / 3, 0.0)  # sequence_mean over 3 sequences
    for fn in (clipped, gspo, gspo_token, cispo):
        _, grad, _ = _grad(fn, lp, lp.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
        torch.testing.assert_close(grad.where(mask, 0.0), expected, rtol=1e-12, atol=1e-15, msg=fn.__name__)


@pytest.mark.parametrize("fn", [gspo, gspo_token, cispo])
def test_dual_clip_is_refused(fn):
    one = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="dual_clip"):
        fn(one, one, one, one.bool(), dual_clip=3.0)
