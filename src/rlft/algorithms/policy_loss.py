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
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)  # [N, T]
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
        metrics = _ratio_metrics(ratio, log_ratio, mask, clip_low, clip_high, adv)
        metrics["clip/dual_frac"] = float((dual_on & mask).sum() / mask.sum().clamp(min=1))
    return loss, metrics


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, mask: Tensor, clip_low: float, clip_high: float,
                   adv: Tensor | None = None) -> dict[str, float]:
    """Clip fractions (of the masked tokens: below 1 - clip_low where A < 0, above 1 + clip_high where
    A > 0; any sign without `adv`) and the range of the ratio the loss uses (a sequence's under
    GSPO); `log_ratio` is the token-level log(pi / pi_old)."""
    low = (ratio < 1 - clip_low) & mask
    high = (ratio > 1 + clip_high) & mask
    if adv is not None:  # a clip only binds where it would move the objective
        low, high = low & (adv < 0), high & (adv > 0)
    n = mask.sum().clamp(min=1).to(ratio.dtype)
    any_tok = bool(mask.any())
    masked_ratio = ratio[mask]
    # How far this update has moved: KL(pi_old || pi), estimated on tokens sampled from pi_old
    # with k3 = (r - 1) - log r, r = pi / pi_old (Schulman, http://joschu.net/blog/kl-approx.html);
    # veRL logs k1 (its ppo_kl) instead.
    approx_kl = torch.where(mask, log_ratio.exp() - 1 - log_ratio, 0.0).sum() / n
    return {"clip/low_frac": float(low.sum() / n), "clip/high_frac": float(high.sum() / n), "clip/dual_frac": 0.0,
            "ratio/mean": float(masked_ratio.mean()) if any_tok else 1.0,
            "ratio/max": float(masked_ratio.max()) if any_tok else 1.0,
            "ratio/min": float(masked_ratio.min()) if any_tok else 1.0,
            "policy/approx_kl": float(approx_kl)}


def _no_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip bounds the token-level clipped surrogate; the {name} loss has no such "
                         "term (use None)")


def _token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    # Padding may hold garbage logprobs: log-ratio 0 there, so nothing non-finite is formed.
    return torch.where(mask, logprobs - old_logprobs.detach(), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's mean of `x` over its masked tokens (0 where x is masked out). On the token
    log-ratios it is log s_i, the log of GSPO's length-normalised sequence ratio
    (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|). `[N, T] -> [N, 1]`."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(x.dtype)
    return x.sum(-1, keepdim=True) / lengths


def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor, *,
         clip_low: float = 3e-4, clip_high: float = 4e-4,
         dual_clip: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al., arXiv:2507.18071): the importance ratio of a whole sequence,
    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), clipped at sequence level:
    loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i), with A_i the sequence's
    advantage (the mean of its token advantages: group advantages are constant along a sequence).

    The sequence's loss is written on each of its tokens, so `loss_agg: sequence_mean` gives the
    paper's objective (1/G sum_i loss_i); token_mean would weigh sequences by length. The paper's
    clip ranges are ~1e-4 (3e-4, 4e-4) because s_i is a geometric mean; clip fractions count
    tokens of clipped sequences.
    """
    _no_dual_clip("gspo", dual_clip)
    mask = completion_mask.bool()
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)  # [N, T]
    seq_ratio = _sequence_mean(log_ratio, mask).exp()  # [N, 1]
    adv = _sequence_mean(torch.where(mask, advantages.detach(), 0.0), mask).to(seq_ratio.dtype)  # [N, 1]
    seq_loss = -torch.minimum(seq_ratio * adv, seq_ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # [N, 1]
    loss = torch.where(mask, seq_loss.expand_as(log_ratio), 0.0)  # [N, T]
    with torch.no_grad():
        ratio = seq_ratio.expand_as(log_ratio)
        metrics = _ratio_metrics(ratio, log_ratio, mask, clip_low, clip_high, adv)
    return loss, metrics


def gspo_token(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor, *,
               clip_low: float = 3e-4, clip_high: float = 4e-4,
               dual_clip: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token (arXiv:2507.18071, section 4.3): per-token advantages with the sequence ratio,
    s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] -- numerically s_i, but each token's gradient is its own
    log-prob's, scaled by s_i; loss_it = -min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it).
    With A_it = A_i along each sequence and `loss_agg: sequence_mean`, its gradient equals GSPO's."""
    _no_dual_clip("gspo_token", dual_clip)
    mask = completion_mask.bool()
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)  # [N, T]
    seq_log_ratio = _sequence_mean(log_ratio, mask).detach()  # [N, 1]
    current = torch.where(mask, logprobs, 0.0)
    ratio = (seq_log_ratio + current - current.detach()).exp()  # [N, T] value s_i, gradient per token
    adv = torch.where(mask, advantages.detach(), 0.0)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    loss = torch.where(mask, loss, 0.0)
    with torch.no_grad():
        metrics = _ratio_metrics(ratio, log_ratio, mask, clip_low, clip_high, adv)
    return loss, metrics


def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor, *,
          clip_low: float = 1.0, clip_high: float = 3.0,
          dual_clip: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update,
    loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t), r_t = pi / pi_old.

    Every token keeps a gradient (a PPO clip zeroes it once the ratio leaves the range, which
    drops the rare "fork" tokens the paper cares about); the clip only bounds its weight. The
    paper sets no lower bound (clip_low = 1: the weight is at least 0 anyway) and tunes the upper
    one. At r = 1 the gradient equals the clipped surrogate's.
    """
    _no_dual_clip("cispo", dual_clip)
    mask = completion_mask.bool()
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)  # [N, T]
    ratio = log_ratio.exp()
    weight = ratio.detach().clamp(1 - clip_low, 1 + clip_high)  # [N, T]
    adv = torch.where(mask, advantages.detach(), 0.0)
    loss = torch.where(mask, -weight * adv * torch.where(mask, logprobs, 0.0), 0.0)  # [N, T]
    with torch.no_grad():
        # a clipped weight (the token still has a gradient), whatever the advantage's sign
        metrics = _ratio_metrics(ratio, log_ratio, mask, clip_low, clip_high)
    return loss, metrics


POLICY_LOSSES: dict[str, PolicyLossFn] = {"clipped": clipped, "gspo": gspo, "gspo_token": gspo_token,
                                          "cispo": cispo}


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
