"""GAE, discounted returns and the clipped value loss."""

from __future__ import annotations

import pytest
import torch

from rlft.algorithms.value import clipped_value_loss, discounted_returns, gae

F64 = dict(dtype=torch.float64)


def test_gae_hand():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72), rewards [0, 0, 1], V [0.5, 0.6, 0.7], V after end = 0
    # t2: delta = 1 - 0.7 = 0.3;               A2 = 0.3
    # t1: delta = 0.9*0.7 - 0.6 = 0.03;        A1 = 0.03 + 0.72*0.3 = 0.246
    # t0: delta = 0.9*0.6 - 0.5 = 0.04;        A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]; the padded 4th column stays 0
    rewards = torch.tensor([[0, 0, 1.0, 5.0]], **F64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], **F64)
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0]], **F64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0]], **F64), rtol=1e-10, atol=1e-12)


def test_discounted_returns_hand():
    # gamma 0.5, rewards [1, 2, 4]: G2 = 4, G1 = 2 + 2 = 4, G0 = 1 + 2 = 3
    r = torch.tensor([[1.0, 2.0, 4.0, 7.0]], **F64)
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(discounted_returns(r, mask, 0.5), torch.tensor([[3.0, 4.0, 4.0, 0.0]], **F64))
    # gamma 1: reverse cumulative sum [7, 6, 4]
    torch.testing.assert_close(discounted_returns(r, mask, 1.0), torch.tensor([[7.0, 6.0, 4.0, 0.0]], **F64))


def test_clipped_value_loss_hand():
    # token 0: V 1.5, old 1.0, R 2.0: unclipped (1.5-2)^2 = 0.25; V clipped to 1.2 -> (1.2-2)^2 = 0.64
    #          max -> 0.64, loss 0.32, counted as clipped
    # token 1: V 0.9, old 1.0, R 2.0: inside the clip range -> 0.5 * 1.1^2 = 0.605
    # token 2: padding (NaN) -> 0
    values = torch.tensor([[1.5, 0.9, float("nan")]], **F64)
    old = torch.tensor([[1.0, 1.0, 0.0]], **F64)
    ret = torch.tensor([[2.0, 2.0, 0.0]], **F64)
    mask = torch.tensor([[True, True, False]])
    loss, m = clipped_value_loss(values, old, ret, mask, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.605, 0.0]], **F64))
    assert m["value/clip_frac"] == 0.5
    assert m["value/mse"] == pytest.approx((0.25 + 1.21) / 2, rel=1e-12)
    # clip=None: plain 0.5 * (V - R)^2 = [0.125, 0.605]
    loss, m = clipped_value_loss(values, old, ret, mask, clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.605, 0.0]], **F64))
    assert m["value/clip_frac"] == 0.0


def test_clipped_value_loss_gradient_hand():
    # clipped token: loss uses the clipped value, which does not depend on V -> grad 0
    # unclipped token: d/dV 0.5 (V - R)^2 = V - R = 0.9 - 2 = -1.1
    values = torch.tensor([[1.5, 0.9]], **F64, requires_grad=True)
    loss, _ = clipped_value_loss(values, torch.tensor([[1.0, 1.0]], **F64), torch.tensor([[2.0, 2.0]], **F64),
                                 torch.ones(1, 2, dtype=torch.bool), clip=0.2)
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.1]], **F64))


def loop_gae_row(r, v, gamma, lam):
    n = len(r)
    adv, a_next = [0.0] * n, 0.0
    for t in range(n - 1, -1, -1):
        v_next = v[t + 1] if t + 1 < n else 0.0
        a_next = r[t] + gamma * v_next - v[t] + gamma * lam * a_next
        adv[t] = a_next
    return adv


def random_padded(seed, N=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return torch.randn(N, T, generator=g, **F64), torch.randn(N, T, generator=g, **F64), mask, lengths.tolist()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_loop(gamma, lam):
    rewards, values, mask, lengths = random_padded(0)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    expected = torch.zeros_like(rewards)
    for i, n in enumerate(lengths):
        expected[i, :n] = torch.tensor(loop_gae_row(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam), **F64)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, 0.0), rtol=1e-10, atol=1e-12)


def test_gae_lambda_one_is_monte_carlo():
    # lam = 1: A_t telescopes to (discounted return-to-go) - V_t
    rewards, values, mask, _ = random_padded(1)
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    expected = torch.where(mask, discounted_returns(rewards, mask, 0.9) - values, 0.0)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_discounted_returns_matches_loop(gamma):
    rewards, _, mask, lengths = random_padded(2)
    out = discounted_returns(rewards, mask, gamma)
    for i, n in enumerate(lengths):
        running = 0.0
        for t in range(n - 1, -1, -1):
            running = float(rewards[i, t]) + gamma * running
            assert float(out[i, t]) == pytest.approx(running, rel=1e-12, abs=1e-12)
    assert torch.all(out[~mask] == 0)


def test_holes_in_mask_equal_packed_row():
    # A masked hole (e.g. tool output) is skipped: same result as the row with the hole removed.
    rewards, values, _, _ = random_padded(3, N=1, T=8)
    mask = torch.tensor([[True, True, False, False, True, True, True, False]])
    adv, ret = gae(rewards, values, mask, 0.95, 0.9)
    keep = mask[0]
    adv_p, ret_p = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum()), dtype=torch.bool), 0.95, 0.9)
    torch.testing.assert_close(adv[:, keep], adv_p, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[:, keep], ret_p, rtol=1e-12, atol=1e-12)
    assert torch.all(adv[:, ~keep] == 0)


def test_rows_are_independent():
    # Batch split invariance: GAE of a subset of rows equals those rows of the full batch.
    rewards, values, mask, _ = random_padded(4)
    adv, ret = gae(rewards, values, mask, 0.9, 0.95)
    for rows in ([0, 1], [2, 3, 4], [5]):
        a, r = gae(rewards[rows], values[rows], mask[rows], 0.9, 0.95)
        torch.testing.assert_close(a, adv[rows], rtol=0, atol=0)
        torch.testing.assert_close(r, ret[rows], rtol=0, atol=0)


def test_clipped_value_loss_matches_loop():
    g = torch.Generator().manual_seed(5)
    values, old, ret = (torch.randn(4, 6, generator=g, **F64) for _ in range(3))
    mask = torch.rand(4, 6, generator=g) > 0.3
    loss, m = clipped_value_loss(values, old, ret, mask, clip=0.3)
    n_clip, sq = 0, 0.0
    for i in range(4):
        for t in range(6):
            v, o, r = float(values[i, t]), float(old[i, t]), float(ret[i, t])
            vc = o + min(max(v - o, -0.3), 0.3)
            exp = 0.5 * max((v - r) ** 2, (vc - r) ** 2) if mask[i, t] else 0.0
            assert float(loss[i, t]) == pytest.approx(exp, rel=1e-12, abs=1e-14)
            if mask[i, t]:
                n_clip += (vc - r) ** 2 > (v - r) ** 2
                sq += (v - r) ** 2
    n = int(mask.sum())
    assert m["value/clip_frac"] == pytest.approx(n_clip / n, rel=1e-12)
    assert m["value/mse"] == pytest.approx(sq / n, rel=1e-12)
