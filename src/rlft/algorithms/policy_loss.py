"""Policy-gradient losses, registered by name behind one signature.

`fn(logprobs [N, T], old_logprobs [N, T], advantages [N, T], completion_mask [N, T] bool, *,
clip_low, clip_high, dual_clip) -> (per-token loss [N, T], metrics)`. The loss is 0 outside the
mask; reducing it to a scalar is `aggregation.aggregate`'s job, and an entropy bonus or KL term
is added by the caller.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

# exp() of a larger log-ratio overflows float32/bf16; such a token is clipped anyway.
_MAX_LOG_RATIO = 20.0


class PolicyLossFn(Protocol):
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
                 *, clip_low: float = 0.2, clip_high: float = 0.2,
                 dual_clip: float | None = None) -> tuple[Tensor, dict[str, float]]: ...


def clipped(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor, *,
            clip_low: float = 0.2, clip_high: float = 0.2,
            dual_clip: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = pi / pi_old.

    Separate low/high clips are DAPO's clip-higher (arXiv:2503.14476): a larger clip_high lets
    unlikely tokens with A > 0 grow, against entropy collapse. Dual clip (arXiv:1912.09729) with
    c > 1 bounds the objective below by c * A when A < 0, so a huge ratio on a bad token cannot
    dominate the batch.
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); use None to turn it off")
    mask = completion_mask.bool()
    # Padding may hold garbage logprobs: ratio 1 and A 0 there, so nothing non-finite is formed.
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    adv = torch.where(mask, advantages.detach(), 0.0)  # [N, T]
    ratio = log_ratio.exp()  # [N, T]
    surrogate = ratio * adv
    surrogate_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(surrogate, surrogate_clipped)  # [N, T]
    dual_on = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -dual_clip * adv  # loss never exceeds this when A < 0
        dual_on = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(mask, loss, 0.0)

    with torch.no_grad():
        n = mask.sum().clamp(min=1).to(ratio.dtype)
        low = (adv < 0) & (ratio < 1 - clip_low) & mask
        high = (adv > 0) & (ratio > 1 + clip_high) & mask
        any_tok = bool(mask.any())
        masked_ratio = ratio[mask]
        # How far this update has moved: KL(pi_old || pi), estimated on tokens sampled from pi_old
        # with k3 = (r - 1) - log r, r = pi / pi_old (Schulman, http://joschu.net/blog/kl-approx.html);
        # veRL logs k1 (its ppo_kl) instead.
        approx_kl = torch.where(mask, ratio - 1 - log_ratio, 0.0).sum() / n
        metrics = {
            "clip/low_frac": float(low.sum() / n),
            "clip/high_frac": float(high.sum() / n),
            "clip/dual_frac": float((dual_on & mask).sum() / n),
            "ratio/mean": float(masked_ratio.mean()) if any_tok else 1.0,
            "ratio/max": float(masked_ratio.max()) if any_tok else 1.0,
            "ratio/min": float(masked_ratio.min()) if any_tok else 1.0,
            "policy/approx_kl": float(approx_kl),
        }
    return loss, metrics


POLICY_LOSSES: dict[str, PolicyLossFn] = {"clipped": clipped}


def truncated_importance_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, completion_mask: Tensor,
                                 cap: float) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights min(pi_trainer / pi_engine, cap) for tokens sampled by an inference engine
    whose numerics differ from the trainer's (truncated importance sampling, as in Yao et al.,
    "Your efficient RL framework secretly brings you off-policy RL training", 2025): the policy
    gradient is taken under pi_trainer, the samples came from pi_engine. Detached; 1 outside the
    mask. `[N, T] -> ([N, T], metrics)`.

    >>> w, _ = truncated_importance_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -2.0]]),
    ...                                     torch.tensor([[True, True]]), cap=2.0)
    >>> w  # exp(0) = 1; exp(2) = 7.39 capped at 2
    tensor([[1., 2.]])
    """
    mask = completion_mask.bool()
    log_ratio = torch.where(mask, trainer_logprobs.detach() - engine_logprobs, 0.0).clamp(max=_MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    weights = ratio.clamp(max=cap)
    n = mask.sum().clamp(min=1)
    metrics = {"rollout/tis_weight_mean": float(torch.where(mask, weights, 0.0).sum() / n),
               "rollout/tis_capped_frac": float(((ratio > cap) & mask).sum() / n)}
    return torch.where(mask, weights, 1.0), metrics
