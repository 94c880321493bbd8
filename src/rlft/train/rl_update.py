"""The learning half of an online step: token rewards, reference log-probs, and mu epochs of
clipped policy-gradient updates over minibatches (each one optimizer step, micro-batched).

Old log-probs are the engine's sampling log-probs: the rollout ran on the very weights being
trained, so they are pi_old without a second forward pass, and the importance ratio measures any
drift between the engine and the trainer (seed 002 §4.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlft.algorithms import KL_ESTIMATORS, POLICY_LOSSES, aggregate, clipped_value_loss
from rlft.models.loading import Reference
from rlft.rollout.batch import RolloutBatch
from rlft.train.logprobs import completion_logprobs
from rlft.train.session import TrainingSession


@dataclass(frozen=True)
class UpdateSettings:
    """Flat algorithm settings, taken from the config once at the loop's boundary."""

    temperature: float
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_estimator: str
    kl_in_loss: bool
    entropy_coef: float
    loss_agg: str
    loss_constant: float | None
    epochs: int
    minibatches: int
    micro_batch_size: int | None
    mask_truncated: bool


def token_rewards(rewards: list[float | None], batch: RolloutBatch, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """`[N, T]`: each sequence reward on its last valid token, minus a per-token KL penalty when
    the KL sits in the reward (seed 002 §4.4). Unverifiable samples get 0 (their advantage is 0)."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    last = batch.completion_mask.sum(-1) - 1  # [N]
    values = torch.tensor([r if r is not None else 0.0 for r in rewards], device=out.device)
    out[torch.arange(batch.size, device=out.device), last.clamp(min=0)] = values
    if kl_penalty is not None:
        out = out - kl_penalty.where(batch.completion_mask, 0.0)
    return out


@torch.no_grad()
def reference_logprobs(reference: Reference, batch: RolloutBatch, temperature: float, micro: int | None) -> torch.Tensor:
    out = torch.zeros_like(batch.sampling_logprobs)
    step = micro or batch.size
    with reference.model() as ref_model:
        for start in range(0, batch.size, step):
            rows = torch.arange(start, min(start + step, batch.size), device=batch.input_ids.device)
            sub = batch.select(rows)
            lp, _ = completion_logprobs(ref_model, sub.input_ids, sub.attention_mask, sub.completion_len, temperature)
            out[rows, : sub.completion_len] = lp
    return out


@torch.no_grad()
def critic_values(critic: Any, model: Any, batch: RolloutBatch, micro: int | None) -> torch.Tensor:
    """Pre-update values `[N, T]` (a shared head reads the policy's hidden states)."""
    out = torch.zeros_like(batch.sampling_logprobs)
    step = micro or batch.size
    was_training = model.training
    model.eval()
    for start in range(0, batch.size, step):
        rows = torch.arange(start, min(start + step, batch.size), device=batch.input_ids.device)
        sub = batch.select(rows)
        hidden = None
        if critic.needs_policy_hidden:
            _, _, hidden = completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.completion_len,
                                               hidden=True)
        out[rows, : sub.completion_len] = critic.values(sub, hidden)
    model.train(was_training)
    return out


@dataclass
class ValueTargets:
    """PPO's critic side of an update: the critic, its pre-update values and GAE returns."""

    critic: Any  # SeparateCritic | SharedValueHead (rlft.train.critic)
    old_values: torch.Tensor  # [N, T]
    returns: torch.Tensor  # [N, T]
    clip: float | None
    coef: float  # weight of the value loss when it shares the policy's optimizer
    train_policy: bool = True  # False during critic warm-up


def policy_update(session: TrainingSession, batch: RolloutBatch, advantages: torch.Tensor,
                  ref_logprobs: torch.Tensor | None, beta: float, s: UpdateSettings,
                  generator: torch.Generator, value: ValueTargets | None = None) -> dict[str, float]:
    """mu epochs x minibatches optimizer steps; returns metrics averaged over them."""
    model = session.policy.model
    model.train()
    if value is not None:
        value.critic.train()
    loss_mask = batch.completion_mask & ~batch.truncated[:, None] if s.mask_truncated else batch.completion_mask
    use_kl = s.kl_in_loss and beta > 0 and ref_logprobs is not None
    # Rows whose advantage is 0 everywhere contribute exactly nothing unless a KL, entropy or value
    # term acts on them: leave them out of the forward pass (the normalisers stay global).
    carries_signal = (advantages != 0).any(-1) | use_kl | (s.entropy_coef > 0) | (value is not None)
    carries_signal &= loss_mask.any(-1)
    stats = _Stats()
    applied_steps = 0
    for _ in range(s.epochs):
        order = torch.randperm(batch.size, generator=generator) if s.minibatches > 1 else torch.arange(batch.size)
        for chunk in order.chunk(s.minibatches):
            chunk = chunk.to(batch.input_ids.device)
            norms = {"num_tokens": float(loss_mask[chunk].sum()), "num_sequences": float(loss_mask[chunk].any(-1).sum())}
            rows = chunk[carries_signal[chunk]]
            if rows.numel() == 0:
                stats.add({"update/skipped_no_signal": 1.0}, 1.0)
                continue
            loss_value = 0.0
            for micro_rows in _micro_batches(batch, rows, s.micro_batch_size):
                sub = batch.select(micro_rows)
                mask = loss_mask[micro_rows, : sub.completion_len]
                loss, m = _micro_loss(model, sub, micro_rows, mask, advantages, ref_logprobs if use_kl else None,
                                      beta, s, norms, value)
                loss.backward()
                loss_value += float(loss.detach())
                stats.add(m, float(mask.sum()))
            if value is not None:
                stats.add(value.critic.step(), 1.0)
            if value is not None and not value.train_policy and not value.critic.shares_policy_optimizer:
                session.optimizer.zero_grad(set_to_none=True)  # warm-up: the policy has no gradient anyway
                applied_steps += 1
                continue
            applied, grad_norm = session.optimizer_step(loss_value)
            if applied:
                applied_steps += 1
                stats.add({"loss": loss_value, "grad_norm": grad_norm}, 1.0)
    out = stats.result()
    out["update/optimizer_steps"] = float(applied_steps)
    return out


def _micro_loss(model: Any, sub: RolloutBatch, rows: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                ref_logprobs: torch.Tensor | None, beta: float, s: UpdateSettings, norms: dict[str, float],
                value: ValueTargets | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch, already divided by the minibatch's global normalisers."""
    t = sub.completion_len
    want_hidden = value is not None and value.critic.needs_policy_hidden
    out = completion_logprobs(model, sub.input_ids, sub.attention_mask, t, s.temperature,
                              entropy="grad" if s.entropy_coef > 0 else "metric", hidden=want_hidden)
    logprobs, entropy = out[0], out[1]
    per_token, m = POLICY_LOSSES["clipped"](logprobs, sub.sampling_logprobs, advantages[rows, :t], mask,
                                            clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip)
    if ref_logprobs is not None:
        per_token = per_token + beta * KL_ESTIMATORS[s.kl_estimator](logprobs, ref_logprobs[rows, :t])
    if s.entropy_coef > 0:
        per_token = per_token - s.entropy_coef * entropy
    loss = aggregate(per_token, mask, s.loss_agg, constant=s.loss_constant, **norms)
    m["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    if value is None:
        return loss, m
    if not value.train_policy:
        loss = loss * 0.0  # critic warm-up: the graph stays connected, the policy gets no gradient
    hidden = out[2] if want_hidden else None
    if hidden is not None and not value.train_policy:
        hidden = hidden.detach()  # warm-up of a shared head must not move the policy's backbone
    values = value.critic.values(sub, hidden)
    value_tok, vm = clipped_value_loss(values, value.old_values[rows, :t], value.returns[rows, :t], mask,
                                       clip=value.clip)
    value_loss = aggregate(value_tok, mask, "token_mean", num_tokens=norms["num_tokens"])
    weight = value.coef if value.critic.shares_policy_optimizer else 1.0  # a separate critic has its own optimizer
    return loss + weight * value_loss, {**m, **vm, "value/loss": float(value_loss.detach()) * norms["num_tokens"]
                                        / max(float(mask.sum()), 1.0)}


def _micro_batches(batch: RolloutBatch, rows: torch.Tensor, size: int | None) -> list[torch.Tensor]:
    """Rows sorted by length, so each micro-batch carries little padding."""
    if size is None or rows.numel() <= size:
        return [rows]
    lengths = batch.attention_mask[rows].sum(-1)
    rows = rows[lengths.argsort(stable=True)]
    return list(rows.split(size))


class _Stats:
    """Weighted means over micro-batches; `*max` / `*min` keys keep the extreme."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            if key.endswith("max"):
                self.sums[key] = max(self.sums.get(key, float("-inf")), value)
                self.weights[key] = 1.0
            elif key.endswith("min"):
                self.sums[key] = min(self.sums.get(key, float("inf")), value)
                self.weights[key] = 1.0
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    def result(self) -> dict[str, float]:
        out = {}
        for key, total in self.sums.items():
            w = self.weights[key]
            out[key] = total if key.endswith(("max", "min")) else (total / w if w else 0.0)
        return out
