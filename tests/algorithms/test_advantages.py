"""Advantage estimators: hand-computed cases, loop oracles, invariances, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.algorithms.advantages import ADVANTAGE_ESTIMATORS, whiten, zero_variance_groups

GROUP_METHODS = ("group_norm", "group_mean", "rloo")


def batch(scores, lengths, T=None, dtype=torch.float64):
    """Right-padded batch with each score on its sample's last valid token."""
    T = T or max(max(lengths), 1)
    rewards = torch.zeros(len(scores), T, dtype=dtype)
    mask = torch.zeros(len(scores), T, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def run(name, rewards, mask, group_ids, valid=None, **kw):
    valid = torch.ones(len(group_ids), dtype=torch.bool) if valid is None else torch.tensor(valid)
    return ADVANTAGE_ESTIMATORS[name](rewards, mask, torch.tensor(group_ids), valid, **kw)


# --- hand-computed -------------------------------------------------------------------------------

def test_group_norm_hand():
    # group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3) = 0.5774 -> adv +-0.5/0.5774 = +-0.8660
    rewards, mask = batch([1, 0, 1, 0], [3, 2, 1, 3])
    adv, m = run("group_norm", rewards, mask, [0, 0, 0, 0])
    expected = torch.tensor([0.8660254, -0.8660254, 0.8660254, -0.8660254], dtype=torch.float64)
    torch.testing.assert_close(adv[mask], expected.repeat_interleave(torch.tensor([3, 2, 1, 3])), rtol=1e-6, atol=0)
    assert torch.all(adv[~mask] == 0)
    assert m["adv/zero_std_group_frac"] == 0.0


def test_group_norm_two_groups_arbitrary_ids():
    # id 7: [1, 3, 5]: mean 3, std sqrt((4+0+4)/2) = 2 -> [-1, 0, 1]
    # id -3: [2, 4]: mean 3, std sqrt(2) = 1.4142 -> [-0.7071, 0.7071]
    rewards, mask = batch([1, 3, 2, 4, 5], [1] * 5)
    adv, _ = run("group_norm", rewards, mask, [7, 7, -3, -3, 7])
    expected = torch.tensor([-1, 0, -0.70710678, 0.70710678, 1], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-7, atol=1e-12)


def test_group_mean_and_rloo_hand():
    rewards, mask = batch([1, 0, 1, 0], [1] * 4)
    adv, _ = run("group_mean", rewards, mask, [0] * 4)
    # mean 0.5 -> +-0.5
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64))
    adv, _ = run("rloo", rewards, mask, [0] * 4)
    # reward 1: others [0, 1, 0] mean 1/3 -> 2/3; reward 0: others [1, 0, 1] mean 2/3 -> -2/3
    torch.testing.assert_close(adv[:, 0], torch.tensor([2, -2, 2, -2], dtype=torch.float64) / 3)


def test_invalid_sample_excluded_from_group_and_zeroed():
    # valid [1, 0, 0]: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.5774
    # -> 1: (2/3)/0.5774 = 1.1547, 0: -(1/3)/0.5774 = -0.5774; the invalid one (NaN reward) -> 0
    rewards, mask = batch([1, 0, float("nan"), 0], [2, 2, 2, 2])
    adv, m = run("group_norm", rewards, mask, [0] * 4, valid=[True, True, False, True])
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.1547005, -0.5773503, 0, -0.5773503], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    assert torch.equal(adv[2], torch.zeros(2, dtype=torch.float64))
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_invalid_sample_gets_exact_zero_in_every_estimator(name):
    rewards, mask = batch([1, 0, 100.0, 0, 2], [2, 3, 2, 1, 3])
    adv, _ = run(name, rewards, mask, [0, 0, 0, 1, 1], valid=[True, True, False, True, True],
                 values=torch.rand(5, 3, dtype=torch.float64))
    assert torch.equal(adv[2], torch.zeros(3, dtype=torch.float64))
    assert torch.all(adv[~mask] == 0)


@pytest.mark.parametrize("name", GROUP_METHODS)
def test_zero_std_group_is_exactly_zero(name):
    x = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert x.sum() / 3 != x[0]  # the naive mean is off by float error, so exact 0 needs handling
    rewards, mask = batch([0.1, 0.1, 0.1, 1.0, 0.0], [2, 1, 3, 2, 2])
    adv, m = run(name, rewards, mask, [4, 4, 4, 9, 9])
    assert torch.equal(adv[:3], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.all(adv[3][mask[3]] != 0)
    assert m["adv/zero_std_group_frac"] == 0.5


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_all_invalid_gives_zeros_without_nan(name):
    rewards, mask = batch([float("nan")] * 4, [2, 3, 1, 3])
    adv, m = run(name, rewards, mask, [0, 0, 1, 1], valid=[False] * 4, values=torch.zeros(4, 3, dtype=torch.float64))
    assert torch.equal(adv, torch.zeros(4, 3, dtype=torch.float64))
    assert all(math.isfinite(v) for v in m.values())
    assert m["adv/zero_std_group_frac"] == 1.0


@pytest.mark.parametrize("name", GROUP_METHODS)
def test_single_sample_groups_give_zeros(name):
    rewards, mask = batch([1.0, 0.0, 3.0], [2, 2, 1])
    adv, m = run(name, rewards, mask, [0, 1, 2])
    assert torch.equal(adv, torch.zeros(3, 2, dtype=torch.float64))
    assert m["adv/zero_std_group_frac"] == 1.0


@pytest.mark.parametrize("name", GROUP_METHODS)
def test_one_valid_member_gives_zero(name):
    rewards, mask = batch([1.0, 0.0, 5.0, 2.0], [1] * 4)
    adv, _ = run(name, rewards, mask, [0, 0, 1, 1], valid=[True, False, True, True])
    assert torch.equal(adv[:2], torch.zeros(2, 1, dtype=torch.float64))


def test_std_floor_prevents_blow_up():
    for dtype in (torch.float32, torch.float64):
        rewards, mask = batch([1.0, 1.0 + 1e-7], [1, 1], dtype=dtype)
        adv, _ = run("group_norm", rewards, mask, [0, 0], std_floor=1e-4)
        assert adv.abs().max() <= 1e-3 and adv.abs().max() > 0
    # float64: deviation +-0.5e-7, std 7.07e-8 < floor -> +-0.5e-7 / 1e-4 = +-5e-4
    torch.testing.assert_close(adv[:, 0], torch.tensor([-5e-4, 5e-4], dtype=torch.float64), rtol=1e-6, atol=0)


def test_zero_variance_groups_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 3.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    valid = torch.tensor([True, True, True, True, True, False, True])
    # group 0 equal; group 1 spread; group 2 one member; group 3 one valid member
    expected = torch.tensor([True, True, False, False, True, True, True])
    assert torch.equal(zero_variance_groups(scores, ids, valid), expected)


def test_reinforce_pp_hand():
    # gamma 0.5: row0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; row1 [1, 0] -> [1, 0]
    # tokens [0.25, 0.5, 1, 1, 0]: mean 0.55, unbiased var 0.8/4 = 0.2, std 0.44721
    rewards = torch.tensor([[0, 0, 1.0], [1.0, 0, 0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, m = ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, mask, torch.tensor([0, 1]), torch.tensor([True, True]),
                                                  gamma=0.5)
    expected = torch.tensor([[-0.67082039, -0.1118034, 1.00623059], [1.00623059, -1.22983739, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-7, atol=1e-12)
    assert abs(m["adv/mean"]) < 1e-12


def test_reinforce_pp_baseline_hand():
    # group 0 scores [1, 0], lengths [2, 1] (gamma 1): returns [1, 1], [0]; baseline 0.5 -> [.5, .5], [-.5]
    # group 1 has one sample (length 1): its own score is the baseline -> [0]
    # tokens [.5, .5, -.5, 0]: batch mean 0.125 -> deviations [.375, .375, -.625, -.125]
    # unbiased var (.140625 * 2 + .390625 + .015625) / 3 = .6875 / 3, std 0.47871355
    # -> [.375, .375] / std = 0.78334945, -.625 / std = -1.30558242, -.125 / std = -0.26111648
    # (before re-centring on the batch mean, the lone sample got 0 and the others +-1.04446594)
    rewards, mask = batch([1.0, 0.0, 3.0], [2, 1, 1])
    adv, m = run("reinforce_pp_baseline", rewards, mask, [0, 0, 1])
    expected = torch.tensor([[0.78334945, 0.78334945], [-1.30558242, 0.0], [-0.26111648, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-7, atol=0)
    assert abs(m["adv/mean"]) < 1e-12  # centred on the batch, as veRL / OpenRLHF / the paper's global norm


def test_reinforce_pp_baseline_zero_variance_group_shifts_with_the_batch():
    # group 4: [0.1] x 3 (all equal), lengths [2, 1, 3] -> centred 0 on its 6 tokens
    # group 9: [1, 0], lengths [3, 1]: mean 0.5 -> [.5, .5, .5], [-.5]
    # 10 tokens, sum 1.5 - 0.5 = 1 -> batch mean 0.1; deviations: six -0.1, three 0.4, one -0.6
    # unbiased var (6 * .01 + 3 * .16 + .36) / 9 = 0.9 / 9 = 0.1 -> adv = deviation * sqrt(10)
    # group 4: -0.1 * 3.16227766 = -0.31622777 on every token of every member (no preference among them)
    # group 9: 0.4 * 3.16227766 = 1.26491106; -0.6 * 3.16227766 = -1.89736660
    rewards, mask = batch([0.1, 0.1, 0.1, 1.0, 0.0], [2, 1, 3, 3, 1])
    adv, m = run("reinforce_pp_baseline", rewards, mask, [4, 4, 4, 9, 9])
    flat = torch.tensor(-0.31622777, dtype=torch.float64)
    torch.testing.assert_close(adv[:3][mask[:3]], flat.expand(6), rtol=1e-7, atol=0)
    torch.testing.assert_close(adv[3], torch.tensor([1.26491106] * 3, dtype=torch.float64), rtol=1e-7, atol=0)
    torch.testing.assert_close(adv[4], torch.tensor([-1.89736660, 0, 0], dtype=torch.float64), rtol=1e-7, atol=0)
    assert torch.all(adv[~mask] == 0)
    assert m["adv/zero_std_group_frac"] == 0.5
    # a batch of only such groups has nothing to re-centre: exactly 0, not noise over the std floor
    rewards, mask = batch([0.1, 0.1, 0.1, 7.0], [2, 1, 3, 2])
    adv, _ = run("reinforce_pp_baseline", rewards, mask, [4, 4, 4, 9])
    assert torch.equal(adv, torch.zeros(4, 3, dtype=torch.float64))


def test_reinforce_pp_all_equal_batch_is_exactly_zero():
    # every sample scores 0.1 on one token: all returns equal -> whitened to exactly 0, not noise / floor
    rewards, mask = batch([0.1, 0.1, 0.1], [1, 1, 1])
    adv, _ = run("reinforce_pp", rewards, mask, [0, 1, 2])
    assert torch.equal(adv, torch.zeros(3, 1, dtype=torch.float64))


def test_gae_requires_values():
    rewards, mask = batch([1.0], [2])
    with pytest.raises(ValueError, match="needs critic values"):
        run("gae", rewards, mask, [0])


def test_whiten_hand_and_all_equal():
    x = torch.tensor([[1.0, 2.0, 3.0], [100.0, 4.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    # [1, 2, 3, 4]: mean 2.5, unbiased std sqrt(5/3) = 1.29099
    out = whiten(x, mask)
    torch.testing.assert_close(out[mask], torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    assert out[1, 0] == 0 and out[1, 2] == 0
    # scale only: [1, 2, 3, 4] / 1.29099
    torch.testing.assert_close(whiten(x, mask, shift_mean=False)[mask], x[mask] / math.sqrt(5 / 3))
    # three equal values whose float mean is not exactly 0.1: still exactly 0
    three = torch.tensor([[True, True, False], [False, True, False]])
    equal = torch.full((2, 3), 0.1, dtype=torch.float64)
    assert equal[three].sum() / 3 != 0.1
    assert torch.equal(whiten(equal, three), torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


# --- oracles: plain Python loops on random batches -------------------------------------------------

def random_batch(seed=0, T=7):
    g = torch.Generator().manual_seed(seed)
    group_ids = [11] * 5 + [3] * 2 + [40] * 4 + [8] * 3 + [-2] * 1 + [5] * 3
    order = torch.randperm(len(group_ids), generator=g).tolist()
    group_ids = [group_ids[i] for i in order]  # groups interleaved, not contiguous
    N = len(group_ids)
    lengths = torch.randint(1, T + 1, (N,), generator=g).tolist()
    lengths[group_ids.index(11)] = 0  # an empty completion
    scores = torch.randint(0, 3, (N,), generator=g).double().tolist()
    rewards, mask = batch(scores, lengths, T)
    # per-token KL-like penalty on valid tokens
    rewards = rewards + torch.where(mask, 0.01 * torch.randn(N, T, generator=g, dtype=torch.float64), 0.0)
    valid = (torch.rand(N, generator=g) > 0.2).tolist()
    # force an all-equal group (id 5) and a group with a single valid member (id 3)
    for i, gid in enumerate(group_ids):
        if gid == 5:
            rewards[i] = 0.0
            rewards[i, lengths[i] - 1] = 0.7
            valid[i] = True
    threes = [i for i, gid in enumerate(group_ids) if gid == 3]
    valid[threes[0]], valid[threes[1]] = True, False
    values = torch.randn(N, T, generator=g, dtype=torch.float64)
    return rewards, mask, group_ids, valid, lengths, values


def loop_group(rewards, mask, group_ids, valid, kind, std_floor):
    N, T = rewards.shape
    scores = [sum(float(rewards[i, t]) for t in range(T) if mask[i, t]) for i in range(N)]
    out = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        if not valid[i]:
            continue
        members = [scores[j] for j in range(N) if group_ids[j] == group_ids[i] and valid[j]]
        if len(members) < 2 or max(members) == min(members):
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1))
        if kind == "group_norm":
            a = (scores[i] - mean) / max(std, std_floor)
        elif kind == "group_mean":
            a = scores[i] - mean
        else:
            a = scores[i] - (sum(members) - scores[i]) / (len(members) - 1)
        for t in range(T):
            if mask[i, t]:
                out[i, t] = a
    return out


def loop_returns(row, n, gamma):
    ret, running = [0.0] * len(row), 0.0
    for t in range(n - 1, -1, -1):
        running = float(row[t]) + gamma * running
        ret[t] = running
    return ret


def loop_whiten(out, cells, shift_mean, std_floor):
    xs = [out[i][t] for i, t in cells]
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    for i, t in cells:
        out[i][t] = ((out[i][t] - mean) if shift_mean else out[i][t]) / max(std, std_floor)
    return out


def loop_reinforce(rewards, lengths, group_ids, valid, gamma, baseline, std_floor):
    N, T = rewards.shape
    out = [[0.0] * T for _ in range(N)]
    scores = [float(rewards[i, : lengths[i]].sum()) for i in range(N)]
    for i in range(N):
        if not valid[i]:
            continue
        ret = loop_returns(rewards[i], lengths[i], gamma)
        b = 0.0
        if baseline:
            members = [scores[j] for j in range(N) if group_ids[j] == group_ids[i] and valid[j]]
            b = scores[i] if (len(members) < 2 or max(members) == min(members)) else sum(members) / len(members)
        for t in range(lengths[i]):
            out[i][t] = ret[t] - b
    cells = [(i, t) for i in range(N) if valid[i] for t in range(lengths[i])]
    return torch.tensor(loop_whiten(out, cells, True, std_floor), dtype=torch.float64)  # both re-centre


def loop_gae(rewards, values, lengths, valid, gamma, lam):
    N, T = rewards.shape
    out = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        if not valid[i]:
            continue
        a_next = 0.0
        for t in range(lengths[i] - 1, -1, -1):
            v_next = float(values[i, t + 1]) if t + 1 < lengths[i] else 0.0
            delta = float(rewards[i, t]) + gamma * v_next - float(values[i, t])
            a_next = delta + gamma * lam * a_next
            out[i, t] = a_next
    return out


@pytest.mark.parametrize("name", GROUP_METHODS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_loop(name, seed):
    rewards, mask, ids, valid, _, _ = random_batch(seed)
    adv, m = run(name, rewards, mask, ids, valid, std_floor=1e-4)
    expected = loop_group(rewards, mask, ids, valid, name, 1e-4)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(adv == 0, expected == 0)  # exact zeros where the loop has them
    assert m["adv/zero_std_group_frac"] >= 2 / 6  # groups 5 (all equal) and 3 (one valid)


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(baseline, gamma):
    rewards, mask, ids, valid, lengths, _ = random_batch(3)
    name = "reinforce_pp_baseline" if baseline else "reinforce_pp"
    adv, _ = run(name, rewards, mask, ids, valid, gamma=gamma, std_floor=1e-4)
    expected = loop_reinforce(rewards, lengths, ids, valid, gamma, baseline, 1e-4)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_estimator_matches_loop(gamma, lam):
    rewards, mask, ids, valid, lengths, values = random_batch(4)
    adv, _ = run("gae", rewards, mask, ids, valid, values=values, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, loop_gae(rewards, values, lengths, valid, gamma, lam), rtol=1e-10, atol=1e-12)


def test_float32_matches_float64():
    rewards, mask, ids, valid, _, _ = random_batch(5)
    for name in ("group_norm", "rloo", "reinforce_pp"):
        a64, _ = run(name, rewards, mask, ids, valid)
        a32, _ = run(name, rewards.float(), mask, ids, valid)
        assert a32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, rtol=1e-5, atol=1e-5)


# --- invariances ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_permutation_and_relabel_invariance(name):
    rewards, mask, ids, valid, _, values = random_batch(6)
    adv, _ = run(name, rewards, mask, ids, valid, values=values, gamma=0.95)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    relabel = {gid: 1000 - 7 * k for k, gid in enumerate(sorted(set(ids)))}
    adv_p, _ = run(name, rewards[perm], mask[perm], [relabel[ids[i]] for i in perm.tolist()],
                   [valid[i] for i in perm.tolist()], values=values[perm], gamma=0.95)
    torch.testing.assert_close(adv_p, adv[perm], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_extra_padding_changes_nothing(name):
    rewards, mask, ids, valid, _, values = random_batch(7)
    adv, m = run(name, rewards, mask, ids, valid, values=values)
    pad = lambda x, fill: torch.cat([x, torch.full((x.shape[0], 4), fill, dtype=x.dtype)], dim=1)  # noqa: E731
    adv_pad, m_pad = run(name, pad(rewards, 123.0), pad(mask, False), ids, valid, values=pad(values, -9.0))
    torch.testing.assert_close(adv_pad[:, : adv.shape[1]], adv, rtol=1e-12, atol=0)
    assert torch.all(adv_pad[:, adv.shape[1]:] == 0)
    assert m_pad == pytest.approx(m, rel=1e-9)


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo"])
def test_a_split_episode_is_one_member_of_its_group(name):
    """An agent program's episode trained as 2 sequences (rows 0-1) counts once in its group's
    baseline: every row gets what the estimator gives its episode over the episodes alone; counted
    twice, it would move the group's mean (and std) toward its own reward."""
    from rlft.algorithms import ADVANTAGE_ESTIMATORS, per_episode

    est = ADVANTAGE_ESTIMATORS[name]
    scores = [1.0, 1.0, 0.0, 0.5, 1.0, 0.0]  # group 0: episodes A (rows 0, 1), B, C; group 1: D, E
    lengths = [3, 2, 4, 1, 2, 3]
    rewards = torch.zeros(6, 4)
    mask = torch.zeros(6, 4, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        rewards[i, n - 1] = s
    groups, valid = torch.tensor([0, 0, 0, 0, 1, 1]), torch.ones(6, dtype=torch.bool)
    leader = torch.tensor([0, 0, 2, 3, 4, 5])
    adv, metrics = per_episode(est, rewards, mask, groups, valid, leader, std_floor=1e-4)
    heads = torch.tensor([0, 2, 3, 4, 5])
    expected, expected_metrics = est(rewards[heads], mask[heads], groups[heads], valid[heads], std_floor=1e-4)
    per_episode_adv = expected[:, 0]
    assert torch.equal(adv[heads], expected) and metrics == expected_metrics
    assert torch.equal(adv[1], torch.where(mask[1], per_episode_adv[0], 0.0))  # A's second sequence: A's value
    naive, _ = est(rewards, mask, groups, valid, std_floor=1e-4)
    assert not torch.allclose(naive[2, 0], adv[2, 0])  # B's advantage did move when A counted twice
