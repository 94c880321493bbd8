"""Critic maths for PPO: GAE and the clipped value loss.

Shapes: N sequences, T completion positions; `completion_mask` is bool [N, T]. Masked positions
are skipped, not treated as steps: the recursion carries its state across them, so a right-padded
row and a row with holes (e.g. tool output left out of the loss) are both handled.

Why skipped for tool output: its tokens are not actions but part of the environment's answer to
the last one, so a step is one sampled token to the next sampled one, and gamma < 1 does not
discount a reward by the length of a tool's reply (V after the reply is read from a state that
includes it).
"""

from __future__ import annotations

import torch
from torch import Tensor


def discounted_returns(token_rewards: Tensor, completion_mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{s>=t} gamma^(s-t) r_s over each row's valid tokens; 0 outside the mask.

    Steps are counted in valid tokens (masked positions are skipped). Returned detached.
    """
    mask = completion_mask.bool()
    rewards = torch.where(mask, token_rewards.detach(), 0.0)  # [N, T]
    if gamma == 1.0:
        # Undiscounted: a reverse cumulative sum, no loop over T.
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask, returns, torch.zeros_like(returns))
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m, running, torch.zeros_like(running))
    return returns


def gae(token_rewards: Tensor, values: Tensor, completion_mask: Tensor, gamma: float, lam: float,
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (arXiv:1506.02438) -> (advantages, returns), both [N, T].

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 after a row's last valid token (the episode
    ends there), A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V. Both are 0 outside the
    mask and detached (they are regression / policy-gradient targets, not graph nodes).
    """
    mask = completion_mask.bool()
    rewards = torch.where(mask, token_rewards.detach(), 0.0)  # [N, T]
    values = torch.where(mask, values.detach(), 0.0)  # [N, T]
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])  # [N]
    next_adv = values.new_zeros(values.shape[0])  # [N]
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # At a masked position keep the state of the next valid token, so holes are skipped.
        next_adv = torch.where(m, adv_t, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = torch.where(m, adv_t, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, completion_mask: Tensor,
                       *, clip: float | None = 0.2) -> tuple[Tensor, dict[str, float]]:
    """Per-token PPO value loss [N, T] (0 outside the mask) and metrics.

    0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2); with clip=None the
    plain 0.5 * (V - R)^2. The max makes clipping pessimistic: it only removes gradient when the
    new value moved more than `clip` away from the rollout-time value in the helpful direction.
    """
    mask = completion_mask.bool()
    unclipped = (values - returns) ** 2  # [N, T]
    if clip is None:
        loss = 0.5 * unclipped
        clipped_on = torch.zeros_like(mask)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped_sq = (v_clipped - returns) ** 2  # [N, T]
        loss = 0.5 * torch.maximum(unclipped, clipped_sq)
        clipped_on = clipped_sq > unclipped
    loss = torch.where(mask, loss, 0.0)
    with torch.no_grad():
        n = mask.sum().clamp(min=1).to(values.dtype)
        metrics = {
            "value/clip_frac": float((clipped_on & mask).sum() / n),
            "value/mse": float(torch.where(mask, unclipped, 0.0).sum() / n),
            "value/mean": float(torch.where(mask, values, 0.0).sum() / n),
        }
    return loss, metrics
