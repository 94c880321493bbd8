"""Offline preference losses (DPO family) and the Bradley-Terry reward-model loss.

Preference losses share `fn(policy_chosen_logps [B], policy_rejected_logps [B], ref_chosen_logps
[B], ref_rejected_logps [B], *, beta=0.1, label_smoothing=0.0) -> (per-pair loss [B], metrics)`.
The caller reduces each answer's token log-probs as `LOGP_REDUCTION[name]` says: summed for DPO
and the hinge, averaged per token for IPO, whose target margin 1/(2 beta) is on a per-token scale
(summed log-probs of long answers would dwarf it). The per-pair loss is returned unreduced so the
caller's mean over the global batch stays exact under gradient accumulation.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class PreferenceLossFn(Protocol):
    def __call__(self, policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
                 ref_rejected_logps: Tensor, *, beta: float = 0.1,
                 label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]: ...


def _implicit_rewards(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float,
                      ) -> tuple[Tensor, Tensor, dict[str, float]]:
    """-> (h = log-ratio margin [B], beta * h [B], metrics). DPO's implicit reward is beta * log(pi/ref)."""
    chosen_ratio = pc - rc  # [B]
    rejected_ratio = pr - rr  # [B]
    h = chosen_ratio - rejected_ratio  # [B]
    with torch.no_grad():
        r_c, r_r = beta * chosen_ratio, beta * rejected_ratio
        metrics = {
            "rewards/chosen": float(r_c.mean()),
            "rewards/rejected": float(r_r.mean()),
            "rewards/margin": float((r_c - r_r).mean()),
            "rewards/accuracy": float((r_c > r_r).to(h.dtype).mean()),
            "logps/chosen": float(pc.mean()),
            "logps/rejected": float(pr.mean()),
        }
    return h, beta * h, metrics


def _no_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing applies to the 'sigmoid' (DPO) loss only; "
                         f"'{name}' got {label_smoothing} (set it to 0)")


def sigmoid(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
            ref_rejected_logps: Tensor, *, beta: float = 0.1,
            label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """DPO (arXiv:2305.18290): -log sigmoid(beta * h). label_smoothing > 0 is conservative DPO
    (cDPO): it assumes that fraction of the labels is flipped, so the loss stops pushing at a
    finite margin."""
    _, logits, metrics = _implicit_rewards(policy_chosen_logps, policy_rejected_logps,
                                           ref_chosen_logps, ref_rejected_logps, beta)
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, metrics


def ipo(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
        ref_rejected_logps: Tensor, *, beta: float = 0.1,
        label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """IPO (arXiv:2310.12036): (h - 1 / (2 beta))^2, beta in tau's role. The squared loss
    regresses the margin to a finite target instead of pushing it to infinity as DPO does."""
    _no_smoothing("ipo", label_smoothing)
    h, _, metrics = _implicit_rewards(policy_chosen_logps, policy_rejected_logps,
                                      ref_chosen_logps, ref_rejected_logps, beta)
    return (h - 1 / (2 * beta)) ** 2, metrics


def hinge(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
          ref_rejected_logps: Tensor, *, beta: float = 0.1,
          label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """SLiC hinge (arXiv:2305.10425) on DPO's logits: relu(1 - beta * h)."""
    _no_smoothing("hinge", label_smoothing)
    _, logits, metrics = _implicit_rewards(policy_chosen_logps, policy_rejected_logps,
                                           ref_chosen_logps, ref_rejected_logps, beta)
    return torch.relu(1 - logits), metrics


PREFERENCE_LOSSES: dict[str, PreferenceLossFn] = {"sigmoid": sigmoid, "ipo": ipo, "hinge": hinge}
# How each loss wants an answer's token log-probs reduced: "sum" or "mean" (per answer token).
LOGP_REDUCTION: dict[str, str] = {"sigmoid": "sum", "ipo": "mean", "hinge": "sum"}


def bradley_terry(chosen_scores: Tensor, rejected_scores: Tensor, *,
                  margin: Tensor | float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Reward-model loss -log sigmoid(s_chosen - s_rejected - margin) per pair [B].

    The optional margin (Llama 2, arXiv:2307.09288) asks clearly-better answers to win by more.
    """
    diff = chosen_scores - rejected_scores  # [B]
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits)
    with torch.no_grad():
        metrics = {
            "rm/accuracy": float((diff > 0).to(diff.dtype).mean()),
            "rm/margin": float(diff.mean()),
        }
    return loss, metrics
