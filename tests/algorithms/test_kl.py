"""KL estimators and KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    ProportionalKLController,
    make_kl_controller,
)

F64 = dict(dtype=torch.float64)


def test_estimators_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], **F64)
    ref = torch.tensor([-2.0, -1.0, -0.5], **F64)
    # d = logp - ref = [1, -1, 0]
    torch.testing.assert_close(KL_ESTIMATORS["k1"](logp, ref), torch.tensor([1.0, -1.0, 0.0], **F64))
    # k2 = 0.5 d^2 = [0.5, 0.5, 0]
    torch.testing.assert_close(KL_ESTIMATORS["k2"](logp, ref), torch.tensor([0.5, 0.5, 0.0], **F64))
    # k3 = e^(-d) + d - 1: e^-1 + 1 - 1 = 0.367879; e^1 - 1 - 1 = 0.718282; 0
    torch.testing.assert_close(KL_ESTIMATORS["k3"](logp, ref), torch.tensor([0.36787944, 0.71828183, 0.0], **F64),
                               rtol=1e-7, atol=1e-12)


def test_k2_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 33, generator=g) * 12
    ref = -torch.rand(64, 33, generator=g) * 12
    assert (KL_ESTIMATORS["k3"](logp, ref) >= 0).all()
    assert (KL_ESTIMATORS["k2"](logp, ref) >= 0).all()
    assert (KL_ESTIMATORS["k1"](logp, ref) < 0).any()  # k1 alone is not: why k3 exists


def test_expectations_match_exact_kl():
    # Oracle: under x ~ pi, E[k1] = E[k3] = KL(pi || ref) exactly; sum over the whole vocabulary.
    # (k3 is exact while every log gap stays inside its bound: e^x - x - 1 <= 10 for x < 2.5.)
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(0.5 * torch.randn(5, 40, generator=g, **F64), -1)  # 5 distributions over 40 tokens
    ref = torch.log_softmax(0.5 * torch.randn(5, 40, generator=g, **F64), -1)
    assert (ref - logp).max() < 2.5
    p = logp.exp()
    exact = (p * (logp - ref)).sum(-1)
    for name in ("k1", "k3"):
        torch.testing.assert_close((p * KL_ESTIMATORS[name](logp, ref)).sum(-1), exact, rtol=1e-10, atol=1e-12)
    # k2 is biased, but matches the KL to second order when the two distributions are close
    close = torch.log_softmax(logp + 1e-3 * torch.randn(5, 40, generator=g, **F64), -1)
    pc = close.exp()
    kl_close = (pc * (close - logp)).sum(-1)
    torch.testing.assert_close((pc * KL_ESTIMATORS["k2"](close, logp)).sum(-1), kl_close, rtol=1e-2, atol=0)


def test_k3_is_bounded_for_a_far_off_token():
    # log ref - log pi = 60: exp(60) - 61 would be 1.1e26 (inf in float16/bf16 and after a few
    # more nats in float32). The gap is clamped to 20 and the estimate to 10.
    logp = torch.tensor([[-70.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-10.0, -1.0]])
    kl = KL_ESTIMATORS["k3"](logp, ref)
    assert kl.tolist() == [[10.0, 0.0]]
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # just inside the bound the estimate is exact: gap x = 2 -> e^2 - 2 - 1
    x = torch.tensor([[2.0]], **F64)
    torch.testing.assert_close(KL_ESTIMATORS["k3"](torch.zeros_like(x), x), x.exp() - x - 1)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_estimators_invariances(name):
    g = torch.Generator().manual_seed(2)
    logp, ref = -torch.rand(6, 10, generator=g, **F64) * 5, -torch.rand(6, 10, generator=g, **F64) * 5
    fn = KL_ESTIMATORS[name]
    full = fn(logp, ref)
    # elementwise: a batch split gives the same per-token values
    torch.testing.assert_close(torch.cat([fn(logp[:2], ref[:2]), fn(logp[2:], ref[2:])]), full, rtol=0, atol=0)
    # depends only on logp - ref
    torch.testing.assert_close(fn(logp - 3.0, ref - 3.0), full, rtol=1e-12, atol=1e-12)
    # matches the formula written out per element
    # (k3 with its bound: min(e^-d + d - 1, 10), gap clamped to +-20)
    formula = {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d,
               "k3": lambda d: min(math.exp(-d) + d - 1, 10.0)}[name]
    for (i, t) in [(0, 0), (3, 7), (5, 9)]:
        d = float(logp[i, t] - ref[i, t])
        assert float(full[i, t]) == pytest.approx(formula(d), rel=1e-12, abs=1e-15)


def test_adaptive_controller_up_down_unchanged():
    # beta 0.1, target 0.02: band is [0.01, 0.03]
    c = AdaptiveKLController(0.1, target=0.02, factor=1.5)
    assert c.update(0.05) == pytest.approx(0.15)  # 0.05 > 0.03 -> 0.1 * 1.5
    assert c.update(0.02) == pytest.approx(0.15)  # inside -> unchanged
    assert c.update(0.03) == pytest.approx(0.15)  # exactly 1.5 x target is not above it
    assert c.update(0.005) == pytest.approx(0.1)  # 0.005 < 0.01 -> 0.15 / 1.5
    assert c.update(0.001) == pytest.approx(0.1 / 1.5)
    assert c.value == pytest.approx(0.1 / 1.5)


def test_controller_state_roundtrip_and_factory():
    c = make_kl_controller(0.2, target=0.1, factor=2.0)
    assert isinstance(c, AdaptiveKLController)
    c.update(1.0)  # 0.2 -> 0.4
    fresh = make_kl_controller(0.2, target=0.1, factor=2.0)
    fresh.load_state_dict(c.state_dict())
    assert fresh.value == pytest.approx(0.4)
    assert fresh.update(0.0) == pytest.approx(0.2)

    f = make_kl_controller(0.05)
    assert isinstance(f, FixedKLController)
    assert f.update(100.0) == 0.05 and f.update(0.0) == 0.05
    f2 = FixedKLController(0.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.05


def test_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="factor"):
        AdaptiveKLController(0.1, target=0.1, factor=1.0)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0)


def test_proportional_controller_hand():
    # Ziegler et al.: beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon
    c = ProportionalKLController(0.1, target=0.02, horizon=1000)
    # KL 0.022: error 0.022/0.02 - 1 = 0.1 (inside the clip); 64 sequences:
    # 0.1 * (1 + 0.1 * 64/1000) = 0.1 * 1.0064 = 0.10064
    assert c.update(0.022, 64) == pytest.approx(0.10064, rel=1e-12)
    # KL 0.1: error 4.0 clipped to 0.2; 500 sequences: 0.10064 * (1 + 0.2 * 0.5) = 0.10064 * 1.1 = 0.110704
    assert c.update(0.1, 500) == pytest.approx(0.110704, rel=1e-12)
    # KL 0: error -1 clipped to -0.2; 1000 sequences: 0.110704 * (1 - 0.2) = 0.0885632
    assert c.update(0.0, 1000) == pytest.approx(0.0885632, rel=1e-12)
    # KL exactly on target: error 0 -> unchanged, however many sequences
    assert c.update(0.02, 10_000) == pytest.approx(0.0885632, rel=1e-12)
    # no sequences, no step
    assert c.update(5.0, 0) == pytest.approx(0.0885632, rel=1e-12)
    # the dead band would not move beta at error 0.1 (KL 1.1 x target): the proportional one does
    d = AdaptiveKLController(0.1, target=0.02)
    assert d.update(0.022) == 0.1


def test_proportional_matches_a_long_run_of_the_formula():
    # Oracle: 50 steps of the formula written out, KL drifting across the target both ways
    c = make_kl_controller(0.05, target=0.1, kind="proportional", horizon=2000)
    assert isinstance(c, ProportionalKLController)
    beta = 0.05
    for t in range(50):
        kl = 0.1 * (1 + 0.5 * math.sin(t / 3))  # 0.05 .. 0.15: clipped at both ends, linear between
        n = 32 + t
        e = max(-0.2, min(0.2, kl / 0.1 - 1))
        beta = beta * (1 + e * n / 2000)
        assert c.update(kl, n) == pytest.approx(beta, rel=1e-12)


def test_proportional_state_roundtrip():
    c = make_kl_controller(0.2, target=0.1, kind="proportional", horizon=100)
    c.update(1.0, 50)  # error clipped to 0.2: 0.2 * (1 + 0.2 * 0.5) = 0.22
    state = c.state_dict()
    assert state == pytest.approx({"value": 0.22, "target": 0.1, "horizon": 100.0})
    fresh = make_kl_controller(0.2, target=0.1, kind="proportional", horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == pytest.approx(0.22)
    # continues where c left off: error -0.2 -> 0.22 * (1 - 0.2 * 0.5) = 0.198
    assert fresh.update(0.0, 50) == pytest.approx(0.198)
    assert c.update(0.0, 50) == pytest.approx(0.198)


def test_proportional_rejects_bad_settings_and_factory_names():
    with pytest.raises(ValueError, match="horizon"):
        ProportionalKLController(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="target"):
        ProportionalKLController(0.1, target=-1.0)
    with pytest.raises(ValueError, match="n_samples"):
        ProportionalKLController(0.1, target=0.1).update(0.1, -1)
    with pytest.raises(ValueError, match="deadband, proportional"):
        make_kl_controller(0.1, target=0.1, kind="pid")
    # no target: a fixed beta whichever controller is named
    assert isinstance(make_kl_controller(0.1, kind="proportional"), FixedKLController)
    assert isinstance(make_kl_controller(0.1, target=0.1), AdaptiveKLController)  # deadband by default
