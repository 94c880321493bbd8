"""AdamW with linear warmup then cosine / linear / constant decay, and gradient clipping."""

from __future__ import annotations

import math

import torch

from rlft.config import TrainingConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainingConfig) -> torch.optim.AdamW:
    if not params:
        raise ValueError("no trainable parameters")
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int):
    warmup = int(round(cfg.warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, cfg.lr_scheduler))


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global gradient norm before clipping (clipping only when max_norm is set)."""
    grads = [p for p in params if p.grad is not None]
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads]) if grads else torch.tensor(0.0)
    else:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    # sharded gradients (FSDP) give a distributed tensor: the norm over every rank's shard
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
