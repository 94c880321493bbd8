"""Preference losses (DPO, IPO, hinge) and the Bradley-Terry reward-model loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.algorithms.preference_losses import PREFERENCE_LOSSES, bradley_terry

F64 = dict(dtype=torch.float64)


def pair(pc, pr, rc, rr, requires_grad=False):
    return [torch.tensor([v], **F64, requires_grad=requires_grad) for v in (pc, pr, rc, rr)]


def softplus(x):  # -log sigmoid(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def test_dpo_hand():
    # pc=-1, rc=-2 (chosen log-ratio +1); pr=-3, rr=-2 (rejected -1): h = 2, logits = 0.1 * 2 = 0.2
    # loss = -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139
    pc, pr, rc, rr = pair(-1.0, -3.0, -2.0, -2.0, requires_grad=True)
    loss, m = PREFERENCE_LOSSES["sigmoid"](pc, pr, rc, rr, beta=0.1)
    assert float(loss.detach()) == pytest.approx(0.598139, rel=1e-6)
    # d loss / d pc = -beta * sigmoid(-0.2) = -0.1 * 0.450166 = -0.0450166
    loss.sum().backward()
    assert float(pc.grad) == pytest.approx(-0.0450166, rel=1e-6)
    assert float(pr.grad) == pytest.approx(0.0450166, rel=1e-6)
    # rewards: chosen 0.1 * 1 = 0.1, rejected 0.1 * -1 = -0.1, margin 0.2
    assert m["rewards/chosen"] == pytest.approx(0.1) and m["rewards/rejected"] == pytest.approx(-0.1)
    assert m["rewards/margin"] == pytest.approx(0.2) and m["rewards/accuracy"] == 1.0
    assert m["logps/chosen"] == -1.0 and m["logps/rejected"] == -3.0


def test_accuracy_counts_ties_as_wrong():
    # pair 1: h = 2 (correct); pair 2: both log-ratios 0 -> tie, not a win -> accuracy 1/2
    pc, pr, rc, rr = (torch.tensor(v, **F64) for v in ([-1.0, -5.0], [-3.0, -6.0], [-2.0, -5.0], [-2.0, -6.0]))
    _, m = PREFERENCE_LOSSES["sigmoid"](pc, pr, rc, rr, beta=0.1)
    assert m["rewards/accuracy"] == 0.5
    _, m = bradley_terry(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
    assert m["rm/accuracy"] == 0.5


def test_cdpo_label_smoothing_hand():
    # 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9 * 0.598139 + 0.1 * 0.798139 = 0.618139
    loss, _ = PREFERENCE_LOSSES["sigmoid"](*pair(-1.0, -3.0, -2.0, -2.0), beta=0.1, label_smoothing=0.1)
    assert float(loss) == pytest.approx(0.618139, rel=1e-6)


def test_ipo_hand():
    # h = 2, beta 0.1 -> target 1 / (2 * 0.1) = 5 -> (2 - 5)^2 = 9
    loss, _ = PREFERENCE_LOSSES["ipo"](*pair(-1.0, -3.0, -2.0, -2.0), beta=0.1)
    assert float(loss) == pytest.approx(9.0)
    # at the target margin the loss is 0: h = 5 with beta 0.1
    loss, _ = PREFERENCE_LOSSES["ipo"](*pair(-1.0, -4.0, -3.0, -1.0), beta=0.1)  # (2) - (-3) = 5
    assert float(loss) == pytest.approx(0.0, abs=1e-12)


def test_hinge_hand():
    # logits 0.2 -> relu(1 - 0.2) = 0.8; logits 0.5 * 3 = 1.5 -> relu(-0.5) = 0
    loss, _ = PREFERENCE_LOSSES["hinge"](*pair(-1.0, -3.0, -2.0, -2.0), beta=0.1)
    assert float(loss) == pytest.approx(0.8)
    loss, _ = PREFERENCE_LOSSES["hinge"](*pair(0.0, -4.0, -1.0, -2.0), beta=0.5)  # h = 1 - (-2) = 3
    assert float(loss) == 0.0


def test_label_smoothing_rejected_where_meaningless():
    for name in ("ipo", "hinge"):
        with pytest.raises(ValueError, match="label_smoothing"):
            PREFERENCE_LOSSES[name](*pair(0.0, 0.0, 0.0, 0.0), label_smoothing=0.1)


def test_bradley_terry_hand():
    # diff 1: -log sigmoid(1) = log(1 + e^-1) = 0.313262; margin 0.5: log(1 + e^-0.5) = 0.474077
    loss, m = bradley_terry(torch.tensor([2.0, 0.0], **F64), torch.tensor([1.0, 0.5], **F64))
    torch.testing.assert_close(loss, torch.tensor([0.3132617, softplus(0.5)], **F64), rtol=1e-6, atol=0)
    assert m["rm/accuracy"] == 0.5 and m["rm/margin"] == pytest.approx((1.0 - 0.5) / 2)
    loss, _ = bradley_terry(torch.tensor([2.0], **F64), torch.tensor([1.0], **F64), margin=0.5)
    assert float(loss) == pytest.approx(0.474077, rel=1e-6)
    loss, _ = bradley_terry(torch.tensor([2.0, 2.0], **F64), torch.tensor([1.0, 1.0], **F64),
                            margin=torch.tensor([0.0, 0.5], **F64))
    torch.testing.assert_close(loss, torch.tensor([0.3132617, 0.474077], **F64), rtol=1e-6, atol=0)


def random_pairs(seed=0, B=16):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(B, generator=g, **F64) * 40 for _ in range(4)]


@pytest.mark.parametrize("name", list(PREFERENCE_LOSSES))
def test_matches_formula_loop(name):
    pc, pr, rc, rr = random_pairs()
    beta, ls = 0.3, (0.2 if name == "sigmoid" else 0.0)
    loss, m = PREFERENCE_LOSSES[name](pc, pr, rc, rr, beta=beta, label_smoothing=ls)
    correct = 0
    for i in range(len(pc)):
        h = (float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i]))
        x = beta * h
        expected = {
            "sigmoid": (1 - ls) * softplus(-x) + ls * softplus(x),
            "ipo": (h - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - x),
        }[name]
        assert float(loss[i]) == pytest.approx(expected, rel=1e-10, abs=1e-12)
        correct += beta * (float(pc[i]) - float(rc[i])) > beta * (float(pr[i]) - float(rr[i]))
    assert m["rewards/accuracy"] == pytest.approx(correct / len(pc))
    assert m["rewards/margin"] == pytest.approx(float((beta * ((pc - rc) - (pr - rr))).mean()), rel=1e-10)


def test_bradley_terry_matches_loop():
    g = torch.Generator().manual_seed(1)
    c, r, margin = (torch.randn(12, generator=g, **F64) * 3 for _ in range(3))
    loss, _ = bradley_terry(c, r, margin=margin)
    for i in range(12):
        assert float(loss[i]) == pytest.approx(softplus(-(float(c[i]) - float(r[i]) - float(margin[i]))), rel=1e-10)


@pytest.mark.parametrize("name", list(PREFERENCE_LOSSES))
def test_invariant_to_shifting_each_answers_logps(name):
    # Only log(pi / ref) matters: adding the same constant to policy and reference of one answer
    # (e.g. a shared prefix's log-prob) changes neither the loss nor its gradient.
    pc, pr, rc, rr = random_pairs(2)
    a = [t.clone().requires_grad_() for t in (pc, pr)]
    b = [t.clone().requires_grad_() for t in (pc + 5.0, pr - 2.0)]
    la, _ = PREFERENCE_LOSSES[name](a[0], a[1], rc, rr, beta=0.2)
    lb, _ = PREFERENCE_LOSSES[name](b[0], b[1], rc + 5.0, rr - 2.0, beta=0.2)
    torch.testing.assert_close(lb, la, rtol=1e-9, atol=1e-12)
    la.sum().backward()
    lb.sum().backward()
    torch.testing.assert_close(b[0].grad, a[0].grad, rtol=1e-9, atol=1e-12)


def test_swapping_answers_flips_label_smoothing():
    # Swapping chosen and rejected negates the logits, which for cDPO is ls -> 1 - ls.
    pc, pr, rc, rr = random_pairs(3)
    l1, _ = PREFERENCE_LOSSES["sigmoid"](pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)
    l2, _ = PREFERENCE_LOSSES["sigmoid"](pr, pc, rr, rc, beta=0.1, label_smoothing=0.8)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(PREFERENCE_LOSSES))
def test_batch_split_mean_equals_full_mean(name):
    # Gradient accumulation: sum over micro-batches of (sum of per-pair loss / global B) == full mean.
    pc, pr, rc, rr = random_pairs(4, B=10)
    p_full = pc.clone().requires_grad_()
    full = PREFERENCE_LOSSES[name](p_full, pr, rc, rr, beta=0.1)[0].mean()
    full.backward()
    p_micro = pc.clone().requires_grad_()
    total = sum(PREFERENCE_LOSSES[name](p_micro[s], pr[s], rc[s], rr[s], beta=0.1)[0].sum() / 10
                for s in (slice(0, 3), slice(3, 4), slice(4, 10)))
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-10, atol=0)
    torch.testing.assert_close(p_micro.grad, p_full.grad, rtol=1e-10, atol=1e-15)
