"""Advantage estimators, registered by name behind one signature.

Every estimator is `fn(token_rewards [N, T], completion_mask [N, T] bool, group_ids [N] long,
valid [N] bool, *, values=None, std_floor=1e-4, gamma=1.0, lam=0.95) -> (advantages [N, T],
metrics)`. `token_rewards` holds the sequence reward on each sample's last valid token, plus a
per-token KL penalty on every valid token when KL is in the reward; a sample's score is the sum
of its valid token rewards.

Rules shared by all estimators:
- advantages are detached and exactly 0 outside the mask and on invalid samples (`valid` False:
  the reward could not be verified); invalid samples are left out of every mean and std;
- a group whose valid scores are all equal, or that has fewer than 2 valid members, gives exactly
  0 for the group methods (group_norm, group_mean, rloo): equality is detected, not left to float
  error. (reinforce_pp_baseline then shifts it with the whole batch: see there.)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from rlft.algorithms.value import discounted_returns
from rlft.algorithms.value import gae as _gae


class AdvantageFn(Protocol):
    def __call__(self, token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor,
                 *, values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
                 lam: float = 0.95) -> tuple[Tensor, dict[str, float]]: ...


class _Groups:
    """Per-group statistics of the valid scores. Groups are indexed 0..G-1 via `index` [N]."""

    def __init__(self, scores: Tensor, group_ids: Tensor, valid: Tensor):
        # Ids are arbitrary ints; unique() maps them to contiguous indices.
        uniq, self.index = torch.unique(group_ids, return_inverse=True)  # [G], [N]
        n_groups = uniq.numel()
        valid = valid.bool()
        w = valid.to(scores.dtype)  # [N]
        safe = torch.where(valid, scores, 0.0)  # [N] an invalid score may be NaN
        self.count = scores.new_zeros(n_groups).scatter_add_(0, self.index, w)  # [G]
        self.sum = scores.new_zeros(n_groups).scatter_add_(0, self.index, safe)  # [G]
        self.mean = self.sum / self.count.clamp(min=1)  # [G]
        dev = torch.where(valid, scores - self.mean[self.index], 0.0)  # [N]
        sq = scores.new_zeros(n_groups).scatter_add_(0, self.index, dev * dev)  # [G]
        self.std = (sq / (self.count - 1).clamp(min=1)).sqrt()  # [G] unbiased
        gmax = scores.new_zeros(n_groups).scatter_reduce_(
            0, self.index, torch.where(valid, scores, float("-inf")), reduce="amax", include_self=False)
        gmin = scores.new_zeros(n_groups).scatter_reduce_(
            0, self.index, torch.where(valid, scores, float("inf")), reduce="amin", include_self=False)
        self.all_equal = gmax == gmin  # [G]; False for a group with no valid member
        # No learning signal: no spread of rewards, or nothing to compare against.
        self.degenerate = self.all_equal | (self.count < 2)  # [G]

    def per_sample(self, x: Tensor) -> Tensor:
        return x[self.index]


def sequence_scores(token_rewards: Tensor, completion_mask: Tensor) -> Tensor:
    """Score per sample [N]: sum of token rewards over valid tokens (padding never counts)."""
    return torch.where(completion_mask.bool(), token_rewards.detach(), 0.0).sum(-1)


def zero_variance_groups(scores: Tensor, group_ids: Tensor, valid: Tensor) -> Tensor:
    """Per sample [N] bool: True where the sample's group has no reward variance.

    That is: all valid scores in the group are equal, or the group has fewer than 2 valid
    members. DAPO dynamic sampling (arXiv:2503.14476) drops such groups: their advantages are 0.
    """
    groups = _Groups(scores.detach(), group_ids, valid)
    return groups.per_sample(groups.degenerate)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, *, std_floor: float = 1e-4) -> Tensor:
    """Normalise x over the True entries of mask; 0 outside the mask.

    shift_mean=True: (x - mean) / max(std, std_floor); shift_mean=False: x / max(std, std_floor),
    i.e. scale only (x is already centred, e.g. by a group baseline), the mean is not added back.
    std is unbiased. If all masked values are equal (or there are none) and shift_mean is True,
    the result is exactly 0.
    """
    mask = mask.bool()
    n = mask.sum().to(x.dtype)
    mean = torch.where(mask, x, 0.0).sum() / n.clamp(min=1)
    var = torch.where(mask, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    scale = var.sqrt().clamp(min=std_floor)
    out = (x - mean) / scale if shift_mean else x / scale
    if shift_mean:
        all_equal = torch.where(mask, x, float("-inf")).amax() == torch.where(mask, x, float("inf")).amin()
        out = out * (~all_equal).to(x.dtype)
    return torch.where(mask, out, 0.0)


def _prep(token_rewards: Tensor, completion_mask: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (rewards [N, T] zeroed outside mask, token mask of valid samples [N, T], scores [N]).

    Statistics are computed in float64 (where the device has it): a float32 group mean of
    nearly-equal rewards can be off by one ulp, which the std floor then magnifies 1e4 times.
    """
    mask = completion_mask.bool()
    work = torch.float32 if token_rewards.device.type == "mps" else torch.float64
    rewards = torch.where(mask, token_rewards.detach().to(work), 0.0)
    return rewards, mask & valid.bool()[:, None], rewards.sum(-1)


def _metrics(adv: Tensor, token_mask: Tensor, groups: _Groups) -> dict[str, float]:
    n = token_mask.sum()
    vals = adv[token_mask]
    return {
        "adv/zero_std_group_frac": float(groups.degenerate.to(adv.dtype).mean()),
        "adv/mean": float(vals.mean()) if n > 0 else 0.0,
        "adv/std": float(vals.std()) if n > 1 else 0.0,
        "adv/max": float(vals.max()) if n > 0 else 0.0,
        "adv/min": float(vals.min()) if n > 0 else 0.0,
    }


def _finish(per_sample: Tensor, token_mask: Tensor, groups: _Groups, dtype: torch.dtype,
            ) -> tuple[Tensor, dict[str, float]]:
    """Zero degenerate groups and invalid samples, broadcast [N] -> [N, T] over valid tokens."""
    per_sample = torch.where(groups.per_sample(groups.degenerate), 0.0, per_sample)  # [N]
    adv = torch.where(token_mask, per_sample[:, None], 0.0)  # [N, T]
    return adv.to(dtype), _metrics(adv, token_mask, groups)


def group_norm(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor, *,
               values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
               lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """GRPO (arXiv:2402.03300): (score - group mean) / max(group std, std_floor)."""
    _, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    adv = (scores - g.per_sample(g.mean)) / g.per_sample(g.std).clamp(min=std_floor)  # [N]
    return _finish(adv, token_mask, g, token_rewards.dtype)


def group_mean(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor, *,
               values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
               lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """Dr. GRPO (arXiv:2503.20783): score - group mean; dividing by the std biases toward easy
    and hard prompts, so it is dropped."""
    _, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    return _finish(scores - g.per_sample(g.mean), token_mask, g, token_rewards.dtype)


def rloo(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor, *,
         values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
         lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """RLOO (arXiv:2402.14740): score - mean of the other valid members of the group."""
    _, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    others = (g.per_sample(g.sum) - scores) / (g.per_sample(g.count) - 1).clamp(min=1)  # [N]
    return _finish(scores - others, token_mask, g, token_rewards.dtype)


def reinforce_pp(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor, *,
                 values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
                 lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ (arXiv:2501.03262): token-level discounted returns, whitened over all valid
    tokens of valid samples in the batch (the batch, not the group, is the baseline)."""
    rewards, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    returns = discounted_returns(rewards, token_mask, gamma)  # [N, T]
    adv = whiten(returns, token_mask, shift_mean=True, std_floor=std_floor)
    return adv.to(token_rewards.dtype), _metrics(adv, token_mask, g)


def reinforce_pp_baseline(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor,
                          valid: Tensor, *, values: Tensor | None = None, std_floor: float = 1e-4,
                          gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++-baseline (arXiv:2501.03262): returns minus the group mean score, then
    normalised over the batch: re-centred on the batch mean of those values over valid tokens and
    divided by their batch std (the paper's global normalisation; veRL and OpenRLHF do the same).

    A group with all-equal scores (or one valid member) uses its own score as the baseline (veRL
    uses 0 for a lone member), so with gamma = 1 and no KL in the reward its centred returns are
    0. The re-centring then gives each of its tokens -(batch mean) / std: one value for all its
    members, so no preference among them. That is 0 up to rounding when the batch mean is 0 (e.g.
    all completions equally long), and exactly 0 when every group in the batch is such a group.
    """
    rewards, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    baseline = torch.where(g.per_sample(g.degenerate), scores, g.per_sample(g.mean))  # [N]
    returns = discounted_returns(rewards, token_mask, gamma)  # [N, T]
    centred = torch.where(token_mask, returns - baseline[:, None], 0.0)
    adv = whiten(centred, token_mask, shift_mean=True, std_floor=std_floor)
    return adv.to(token_rewards.dtype), _metrics(adv, token_mask, g)


def gae(token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor, valid: Tensor, *,
        values: Tensor | None = None, std_floor: float = 1e-4, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """PPO's GAE (arXiv:1506.02438), see `value.gae`. Advantages only, not whitened: the caller
    builds value targets as advantages + values, then may `whiten` advantages for the policy."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values: pass values=[N, T] "
                         "(PPO with a value model); the group estimators need none")
    rewards, token_mask, scores = _prep(token_rewards, completion_mask, valid)
    g = _Groups(scores, group_ids, valid)
    adv, _ = _gae(rewards, values.to(rewards.dtype), token_mask, gamma, lam)
    return adv.to(token_rewards.dtype), _metrics(adv, token_mask, g)


# the estimators whose advantage is one number per sample from its group's scores: `per_episode` applies
EPISODE_LEVEL = ("group_norm", "group_mean", "rloo")


def per_episode(estimator: AdvantageFn, token_rewards: Tensor, completion_mask: Tensor, group_ids: Tensor,
                valid: Tensor, leader: Tensor, **kwargs: Any) -> tuple[Tensor, dict[str, float]]:
    """A group estimator (EPISODE_LEVEL) over episodes instead of rows, when an episode was trained
    as several sequences (an agent program that re-rendered its history): `leader[i]` is the row of
    the first sequence of row i's episode (i itself for an episode of one row). The estimator sees
    each episode once, at its leader, so a split episode weighs in its group's mean and std as one
    member; every row of the episode gets its leader's advantage over its own valid tokens.

    >>> r = torch.tensor([[1.0], [1.0], [0.0], [0.5]]); m = torch.ones(4, 1, dtype=torch.bool)
    >>> g, v, lead = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 2, 3])
    >>> per_episode(group_mean, r, m, g, v, lead)[0].squeeze(1).tolist()
    [0.5, 0.5, -0.5, 0.0]
    """
    n = leader.shape[0]
    heads = torch.nonzero(leader == torch.arange(n, device=leader.device)).squeeze(1)
    adv, metrics = estimator(token_rewards[heads], completion_mask[heads], group_ids[heads], valid[heads], **kwargs)
    mask = completion_mask.bool()[heads] & valid.bool()[heads][:, None]
    per_head = (adv.to(torch.float64) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [E]: constant over tokens
    slot = torch.full((n,), -1, dtype=torch.long, device=leader.device)
    slot[heads] = torch.arange(heads.shape[0], device=leader.device)
    per_row = per_head[slot[leader]]  # [N]
    token_mask = completion_mask.bool() & valid.bool()[:, None]
    return torch.where(token_mask, per_row[:, None], 0.0).to(token_rewards.dtype), metrics


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "group_norm": group_norm,
    "group_mean": group_mean,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae,
}


def reverse_kl_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor,
                          completion_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """On-policy distillation's per-token advantage (arXiv:2306.13649; Thinking Machines' "on-policy
    distillation" recipe): A_t = log pi_teacher(y_t) - log pi_student(y_t), the negated per-token
    reverse KL estimate on the student's own sample, with no discounting (each token answers for
    itself). Maximising sum_t A_t log pi_student(y_t) lowers KL(student || teacher).
    `[N, T] -> ([N, T], metrics)`; 0 outside the mask.

    >>> adv, m = reverse_kl_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -3.0]]),
    ...                                torch.tensor([[True, True]]))
    >>> adv  # the teacher likes token 1 more (+0.5), token 2 less (-1.0)
    tensor([[ 0.5000, -1.0000]])
    >>> m["distill/reverse_kl"]  # mean of student - teacher: (-0.5 + 1.0) / 2
    0.25
    """
    mask = completion_mask.bool()
    adv = torch.where(mask, teacher_logprobs.detach() - student_logprobs.detach(), 0.0)  # [N, T]
    n = mask.sum().clamp(min=1)
    return adv, {"distill/reverse_kl": float(-adv.sum() / n)}
