"""The learning half of an online step: token rewards, reference log-probs, and mu epochs of
clipped policy-gradient updates over minibatches (each one optimizer step, micro-batched).

Old log-probs (pi_old of the importance ratio) are the trainer's own, never the engine's: with one
epoch and one minibatch they are the detached log-probs of the very forward that trains (ratio
exactly 1), otherwise a no-grad pass computes them before the first update. The engine's sampling
log-probs are compared with them on the first pass (`rollout/logprob_diff_*`,
`rollout/ratio_mean`): the mismatch between two implementations of one policy is measured, not
mixed into the clipping, and `rollout_correction: tis` corrects for it with truncated importance
weights. `rollout_correction: bypass` departs from this on purpose: the engine's log-probs are
pi_old, so the clipped ratio itself is the correction (for asynchronous rollouts, whose sampler
runs k steps behind: the mismatch then includes those k steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
from torch import Tensor

from rlft.algorithms import KL_ESTIMATORS, POLICY_LOSSES, aggregate
from rlft.algorithms.policy_loss import truncated_importance_weights
from rlft.config import Config
from rlft.models.forward import completion_logprobs
from rlft.models.loading import Reference
from rlft.monitor.stats import MetricAccumulator
from rlft.rollout.batch import RolloutBatch
from rlft.training.distributed import SINGLE, World, loss_scale


@dataclass(frozen=True)
class UpdateSettings:
    """Flat algorithm settings, taken from the config once at the loop's boundary."""

    temperature: float
    advantage: str
    std_floor: float
    gamma: float
    lam: float
    kl_in_reward: bool
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
    policy_loss: str = "clipped"  # a name in algorithms.POLICY_LOSSES
    rollout_correction: str = "none"
    tis_cap: float = 2.0
    packing: bool = False  # padding-free policy/reference forwards (same numbers as padded)
    shared_prefix: str = "off"  # 'auto' | 'on' | 'off': a group's prompt computed once (same numbers)
    split_staleness: bool = False  # rollout.async_steps > 0: mismatch metrics again per staleness

    @classmethod
    def from_config(cls, config: Config) -> "UpdateSettings":
        a = config.algorithm
        return cls(temperature=config.rollout.temperature, advantage=a.advantage, std_floor=a.std_floor,
                   gamma=a.gamma, lam=a.lam, kl_in_reward=a.kl_in == "reward",
                   policy_loss=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high,
                   dual_clip=a.dual_clip, kl_estimator=a.kl_estimator, kl_in_loss=a.kl_in == "loss",
                   entropy_coef=a.entropy_coef, loss_agg=a.loss_agg, loss_constant=a.loss_constant,
                   epochs=a.epochs, minibatches=a.minibatches, micro_batch_size=a.micro_batch_size,
                   mask_truncated=a.mask_truncated, rollout_correction=a.rollout_correction, tis_cap=a.tis_cap,
                   packing=config.training.packing, shared_prefix=config.training.shared_prefix,
                   split_staleness=config.rollout.async_steps > 0)

    @property
    def single_pass(self) -> bool:
        """One optimizer step per rollout batch: pi_old is the training forward itself."""
        return self.epochs == 1 and self.minibatches == 1


class Trainer(Protocol):
    """What an update needs of the training session."""

    policy: Any

    def autocast(self) -> Any:
        """The context training forwards run in (the run's mixed precision; with training.compile,
        compiled decoder layers)."""

    def backward(self, loss: Tensor) -> None:
        """loss.backward(), loss-scaled under fp16."""

    def optimizer_step(self, loss_value: float) -> tuple[bool, float]: ...


class AuxLoss(Protocol):
    """A loss on other data added once per optimizer step (algorithm.sft_mix: an SFT NLL)."""

    def __call__(self, model: Any) -> tuple[Tensor, dict[str, float]]: ...


class ExtraLoss(Protocol):
    """A loss term computed from the policy's own forward and trained by its optimizer (PPO's
    shared value head). `rows` index the full batch; `hidden` is `[n, T, H]` when needs_hidden."""

    needs_hidden: bool

    def __call__(self, sub: RolloutBatch, rows: Tensor, hidden: Tensor | None, mask: Tensor,
                 num_tokens: float) -> tuple[Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class LossInputs:
    """What the policy loss reads per token besides its own forward, for the whole batch; `rows()`
    cuts out a micro-batch's (the sampler's log-probs already travel in the micro-batch itself)."""

    advantages: Tensor  # [N, T]
    loss_mask: Tensor  # [N, T] bool
    old_logprobs: Tensor | None  # [N, T]; None: single pass, the training forward is pi_old
    ref_logprobs: Tensor | None  # [N, T]; None: no KL term in the loss

    def rows(self, rows: Tensor, width: int) -> "LossInputs":
        """These rows, cut to a micro-batch's `width` completion columns (each `[n, width]`)."""
        return LossInputs(self.advantages[rows, :width], self.loss_mask[rows, :width],
                          _cut(self.old_logprobs, rows, width), _cut(self.ref_logprobs, rows, width))


def _cut(values: Tensor | None, rows: Tensor, width: int) -> Tensor | None:
    return None if values is None else values[rows, :width]  # [n, width]


def minibatch_schedule(batch_size: int, s: UpdateSettings, generator: torch.Generator,
                       device: torch.device | None = None) -> Iterator[Tensor]:
    """The rows of each minibatch (`[m]`), epochs x minibatches: the one schedule of the policy
    and the critic updates, one permutation per epoch from `generator`, drawn as the epoch begins and
    only with several minibatches (runs and resumes are compared bitwise, so the draws must not move)."""
    for _ in range(s.epochs):
        order = torch.randperm(batch_size, generator=generator) if s.minibatches > 1 else torch.arange(batch_size)
        for chunk in order.chunk(s.minibatches):
            yield chunk.to(device) if device is not None else chunk


def token_rewards(rewards: list[float | None], batch: RolloutBatch, kl_penalty: Tensor | None) -> Tensor:
    """`[N, T]`: each sequence reward on its last policy token, minus a per-token KL penalty when
    the KL sits in the reward (Ouyang et al., arXiv:2203.02155). Unverifiable samples get 0 (their
    advantage is 0)."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    last = last_true_index(batch.completion_mask)  # [N]
    values = torch.tensor([r if r is not None else 0.0 for r in rewards], device=out.device)
    out[torch.arange(batch.size, device=out.device), last.clamp(min=0)] = values
    if kl_penalty is not None:
        out = out - kl_penalty.where(batch.completion_mask, 0.0)
    return out


def last_true_index(mask: Tensor) -> Tensor:
    """Column of each row's last True  # [N]; -1 for an empty row. Not `mask.sum() - 1`: a
    multi-turn mask has holes (tool tokens) and its last policy token is further right."""
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # [T]
    return (mask.long() * columns).amax(-1) - 1


def lockstep_chunks(world: World, n_rows: int, size: int | None) -> list[Tensor | None]:
    """Row ranges [0, n) in chunks of `size`, padded with None to the busiest rank's count: a
    sharded model's forward is collective, so every rank runs it as often (None: a throwaway
    forward on row 0)."""
    step = size or max(n_rows, 1)
    chunks: list[Tensor | None] = [torch.arange(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]
    return chunks + [None] * (int(world.max([len(chunks)])[0]) - len(chunks))


@torch.no_grad()
def batch_logprobs(model: Any, batch: RolloutBatch, temperature: float, micro: int | None,
                   world: World = SINGLE, packing: bool = False, shared_prefix: str = "off") -> Tensor:
    """Log-probs of every completion token under `model`, in micro-batches, no gradient  # [N, T]"""
    out = torch.zeros_like(batch.sampling_logprobs)
    for rows in lockstep_chunks(world, batch.size, micro):
        sub = batch.select(rows if rows is not None else torch.arange(1))
        lp, _ = completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.completion_len, temperature,
                                    packing=packing, shared_prefix=shared_prefix)
        if rows is not None:
            out[rows.to(out.device), : sub.completion_len] = lp
    return out


def reference_logprobs(reference: Reference, batch: RolloutBatch, temperature: float, micro: int | None,
                       world: World = SINGLE, packing: bool = False, shared_prefix: str = "off") -> Tensor:
    with reference.model() as ref_model:
        return batch_logprobs(ref_model, batch, temperature, micro, world, packing, shared_prefix)


def engine_mismatch(trainer_lp: Tensor, engine_lp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's on the same tokens, before
    any update: |diff| mean / max, and the mean engine-to-trainer importance ratio (1 when both
    compute the same policy; a mean above ~1.3 means off-policy training)."""
    mask = mask.bool()
    n = mask.sum().clamp(min=1)
    diff = torch.where(mask, trainer_lp.detach() - engine_lp, 0.0)
    return {"rollout/logprob_diff_mean": float(diff.abs().sum() / n),
            "rollout/logprob_diff_max": float(diff.abs().max()) if bool(mask.any()) else 0.0,
            "rollout/ratio_mean": float(torch.where(mask, diff.clamp(max=20).exp(), 0.0).sum() / n)}


def policy_update(trainer: Trainer, batch: RolloutBatch, advantages: Tensor, ref_logprobs: Tensor | None,
                  beta: float, s: UpdateSettings, generator: torch.Generator,
                  extra: ExtraLoss | None = None, aux: AuxLoss | None = None) -> dict[str, float]:
    """mu epochs x minibatches optimizer steps; returns metrics averaged over them (over every rank's
    tokens in a distributed run, where each rank updates on its own rows). `aux` adds its loss to
    every optimizer step."""
    model = trainer.policy.model
    world = getattr(trainer, "world", SINGLE)
    model.train()
    loss_mask = batch.loss_mask(s.mask_truncated)
    use_kl = s.kl_in_loss and beta > 0 and ref_logprobs is not None
    # Rows whose advantage is 0 everywhere contribute exactly nothing unless a KL, entropy or extra
    # term acts on them: leave them out of the forward pass (the normalisers stay global).
    carries_signal = (advantages != 0).any(-1) | use_kl | (s.entropy_coef > 0) | (extra is not None)
    carries_signal &= loss_mask.any(-1)
    stats = MetricAccumulator()
    bypass = s.rollout_correction == "bypass"
    old_logprobs = batch.sampling_logprobs if bypass else None
    if not bypass and not s.single_pass and world.any(bool(carries_signal.any())):
        with trainer.autocast():
            old_logprobs = batch_logprobs(model, batch, s.temperature, s.micro_batch_size, world, s.packing,
                                          s.shared_prefix)
        stats.add(engine_mismatch(old_logprobs, batch.sampling_logprobs, loss_mask))
    # the minibatches and micro-batches below only choose rows of these
    inputs = LossInputs(advantages, loss_mask, old_logprobs, ref_logprobs if use_kl else None)
    applied_steps, stepped = 0, False
    for chunk in minibatch_schedule(batch.size, s, generator, batch.input_ids.device):
        # the minibatch's normalisers count every rank's tokens: the ranks' losses add up to it
        tokens, sequences = world.sum([float(loss_mask[chunk].sum()), float(loss_mask[chunk].any(-1).sum())])
        norms = {"num_tokens": tokens, "num_sequences": sequences}
        rows = chunk[carries_signal[chunk]]
        if aux is None and not world.any(rows.numel() > 0):  # no rank has a row that moves the loss
            stats.add({"update/skipped_no_signal": 1.0})
            continue
        micro = _micro_batches(batch, rows, s.micro_batch_size, s.shared_prefix != "off") if rows.numel() else []
        loss_value = 0.0
        for i in range(int(world.max([len(micro)])[0])):
            real = i < len(micro)
            micro_rows = micro[i] if real else torch.zeros(1, dtype=torch.long, device=chunk.device)
            sub = batch.select(micro_rows)
            part = inputs.rows(micro_rows, sub.completion_len)
            # the engine's numbers against the trainer's, before any update (bypass: its first one)
            measure = part.old_logprobs is None or (bypass and not stepped)  # (no step yet: none applied either)
            with trainer.autocast():
                loss, m = _micro_loss(model, sub, micro_rows, part, beta, s, norms, extra, measure)
            # a throwaway micro-batch (a rank with fewer rows) only keeps the collectives in step
            trainer.backward(loss * (loss_scale(world) if real else 0.0))
            if real:
                loss_value += float(loss.detach())
                stats.add(m, float(part.loss_mask.sum()))
        if aux is not None:  # one batch of its rows per optimizer step, on every rank
            with trainer.autocast():
                aux_loss, m = aux(model)
            trainer.backward(aux_loss * loss_scale(world))
            loss_value += float(aux_loss.detach())
            stats.add(m)
        applied, grad_norm = trainer.optimizer_step(loss_value)
        stepped = True
        if applied:
            applied_steps += 1
            stats.add({"loss": world.sum([loss_value])[0], "grad_norm": grad_norm})
    out = stats.reduce(world).means()
    out["update/optimizer_steps"] = float(applied_steps)
    return out


def _micro_loss(model: Any, sub: RolloutBatch, rows: Tensor, inputs: LossInputs, beta: float, s: UpdateSettings,
                norms: dict[str, float], extra: ExtraLoss | None,
                measure_engine: bool = False) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch (`sub`: the batch's `rows`; `inputs`: cut to them), already divided
    by the minibatch's global normalisers. `measure_engine`: also compare the engine's sampling
    log-probs with this forward's."""
    t = sub.completion_len
    mask, old, ref = inputs.loss_mask, inputs.old_logprobs, inputs.ref_logprobs  # [n, t]
    want_hidden = extra is not None and extra.needs_hidden
    out = completion_logprobs(model, sub.input_ids, sub.attention_mask, t, s.temperature,
                              entropy="grad" if s.entropy_coef > 0 else "metric", hidden=want_hidden,
                              packing=s.packing, shared_prefix=s.shared_prefix)
    logprobs, entropy = out[0], out[1]  # [n, t]
    metrics: dict[str, float] = {}
    if old is None:  # single pass: this forward is pi_old
        old = logprobs.detach()
    if measure_engine:
        metrics.update(engine_mismatch(logprobs.detach(), sub.sampling_logprobs, mask))
    per_token, m = POLICY_LOSSES[s.policy_loss](logprobs, old, inputs.advantages, mask,
                                                clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip)
    metrics.update(m)
    if s.rollout_correction == "tis":
        weights, tm = truncated_importance_weights(old, sub.sampling_logprobs, mask, s.tis_cap)
        per_token = per_token * weights
        metrics.update(tm)
    if ref is not None:
        per_token = per_token + beta * KL_ESTIMATORS[s.kl_estimator](logprobs, ref)
    if s.entropy_coef > 0:
        per_token = per_token - s.entropy_coef * entropy
    loss = aggregate(per_token, mask, s.loss_agg, constant=s.loss_constant, **norms)
    metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    if extra is not None:
        extra_loss, em = extra(sub, rows, out[2] if want_hidden else None, mask, norms["num_tokens"])
        loss = loss + extra_loss
        metrics.update(em)
    return loss, metrics


def _micro_batches(batch: RolloutBatch, rows: Tensor, size: int | None, by_group: bool = False) -> list[Tensor]:
    """Rows sorted by length, so each micro-batch carries little padding; with `by_group`, by
    group first, so a group's rows share a micro-batch (and one copy of their prompt)."""
    if size is None or rows.numel() <= size:
        return [rows]
    return list(rows[rows_in_order(batch, rows, by_group)].split(size))


def rows_in_order(batch: RolloutBatch, rows: Tensor, by_group: bool) -> Tensor:
    """The order of `rows` for micro-batching: by length, or by (group, length)  # [n]"""
    lengths = batch.attention_mask[rows].sum(-1)
    order = lengths.argsort(stable=True)
    if by_group:
        order = order[batch.group_ids[rows][order].argsort(stable=True)]
    return order
