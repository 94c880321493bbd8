"""The offline loop: batches from a dataset, no rollouts (SFT, DPO, reward-model training).

An objective supplies the data, the per-step normaliser and the loss; the loop owns the order of
rows, gradient accumulation, the optimizer step, evaluation and checkpoints. Each micro-batch loss
is divided by the normaliser of the whole step (e.g. its target-token count), so accumulating
micro-batches gives exactly the gradient of one large batch.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import torch

from rlft.config import Config
from rlft.models.loading import LoadedModel, load_policy
from rlft.train.session import TrainingSession


class OfflineObjective(Protocol):
    title: str
    progress_keys: list[str]

    def prepare(self, session: TrainingSession) -> tuple[list[Any], list[Any]]:
        """(train examples, eval examples); validation errors are raised here, before training."""

    def normaliser(self, examples: list[Any]) -> float:
        """What one optimizer step's summed loss is divided by (tokens, pairs...)."""

    def loss(self, model: Any, examples: list[Any], normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of a micro-batch, already divided by the step's normaliser; metrics are additive."""

    def evaluate(self, session: TrainingSession, examples: list[Any]) -> dict[str, float]:
        """Held-out metrics, named `eval/...`."""

    # Optional: `load_model(model_cfg, lora_cfg) -> LoadedModel` when the objective trains something
    # other than a causal LM (reward-model training: a sequence classifier); default `load_policy`.


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def run_offline(config: Config, objective: OfflineObjective, policy: LoadedModel | None = None) -> dict[str, Any]:
    session = TrainingSession(config, policy, getattr(objective, "load_model", load_policy))
    train, evals = objective.prepare(session)
    tc = config.training
    batch, micro = tc.batch_size, tc.micro_batch_size or tc.batch_size
    steps_per_epoch = math.ceil(len(train) / batch)
    total = steps_per_epoch * tc.epochs
    if tc.max_steps:
        total = min(total, tc.max_steps)
    session.start(total, objective.progress_keys, objective.title)
    position = {"epoch": 0, "batch": 0}
    session.extra_state = lambda: {"data": dict(position, seed=config.seed, rows=len(train))}
    state = session.resume()
    if state is not None:
        position.update(epoch=state["data"]["epoch"], batch=state["data"]["batch"])
    model = session.policy.model
    model.train()
    eval_metrics: dict[str, float] = {}
    try:
        def done() -> bool:
            return session.step >= total or session.stop_signal is not None

        while position["epoch"] < tc.epochs and not done():
            epoch = position["epoch"]
            order = epoch_order(len(train), config.seed, epoch, config.data.shuffle)
            for b in range(position["batch"], steps_per_epoch):
                if done():
                    break
                examples = [train[i] for i in order[b * batch:(b + 1) * batch]]
                metrics = _train_step(session, objective, model, examples, micro)
                at_end = b + 1 == steps_per_epoch
                position.update(epoch=epoch + at_end, batch=0 if at_end else b + 1)
                if metrics is None:  # skipped: non-finite loss or gradient
                    continue
                metrics["epoch"] = epoch + (b + 1) / steps_per_epoch
                if evals and session.eval_due():
                    eval_metrics = objective.evaluate(session, evals)
                    metrics.update(eval_metrics)
                    model.train()
                session.log(metrics)
                if session.checkpoint_due():
                    session.save_checkpoint()
        if evals and session.stop_signal is None and session.step < total:  # ended early (skipped steps)
            eval_metrics = objective.evaluate(session, evals)
            session.log_eval(eval_metrics)
    finally:
        session.close_display()
    train_metrics = _last_train_metrics(session)
    return session.finish({**train_metrics, **eval_metrics})


def _train_step(session: TrainingSession, objective: OfflineObjective, model: Any, examples: list[Any],
                micro: int) -> dict[str, float] | None:
    start = time.perf_counter()
    norm = objective.normaliser(examples)
    loss_total = 0.0
    sums: dict[str, float] = {}
    for i in range(0, len(examples), micro):
        loss, m = objective.loss(model, examples[i:i + micro], norm)
        loss.backward()
        loss_total += float(loss.detach())
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    lr = session.lr
    applied, grad_norm = session.optimizer_step(loss_total)
    if not applied:
        return None
    session.step += 1
    elapsed = time.perf_counter() - start
    out = {"loss": loss_total, "lr": lr, "grad_norm": grad_norm, "nonfinite_skipped": session.nonfinite_total,
           "step_time": elapsed, **sums}
    if "tokens" in sums:
        out["tokens_per_s"] = sums["tokens"] / elapsed
    return out


def _last_train_metrics(session: TrainingSession) -> dict[str, float]:
    records = [r for r in session.run.read_metrics() if "loss" in r]
    return {f"train/{k}": v for k, v in records[-1].items() if k in ("loss", "grad_norm")} if records else {}
