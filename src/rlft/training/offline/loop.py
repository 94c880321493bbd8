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
from rlft.data.mixing import TrainRows
from rlft.data.order import BatchCursor
from rlft.eval.suites import prepare_suites
from rlft.models.loading import LoadedModel, load_policy
from rlft.monitor.stats import MetricAccumulator
from rlft.rollout import build_engine
from rlft.training.distributed import SINGLE, World, loss_scale
from rlft.training.offline.dpo import DpoObjective
from rlft.training.offline.reward_model import RewardModelObjective
from rlft.training.offline.sft import SftObjective
from rlft.training.session import TrainingSession, evaluation, prepared_run


class OfflineObjective(Protocol):
    title: str
    progress_keys: list[str]

    def prepare(self, policy: LoadedModel) -> tuple[TrainRows | list[Any], list[Any], dict[str, Any]]:
        """(train rows -- data.train's sources, data/mixing.py -- or a plain list, eval examples, data
        statistics for the summary); validation errors are raised here, before training."""

    def normaliser(self, examples: list[Any]) -> float:
        """What one optimizer step's summed loss is divided by (tokens, pairs...)."""

    def loss(self, model: Any, examples: list[Any], normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of a micro-batch, already divided by the step's normaliser; metrics are additive."""

    def evaluate(self, policy: LoadedModel, examples: list[Any]) -> dict[str, float]:
        """Held-out metrics, named `eval/...`."""

    # Optional: `load_model(model_cfg, lora_cfg) -> LoadedModel` when the objective trains something
    # other than a causal LM (reward-model training: a sequence classifier); default `load_policy`.


def make_objective(config: Config) -> OfflineObjective:
    """The offline objective of `config.method`, given the config sections it reads."""
    chunk = config.training.micro_batch_size or config.training.batch_size
    if config.method == "sft":
        return SftObjective(config.data, config.eval, config.rewards, config.seed, config.scoring,
                            packing=config.training.packing, agent=config.agent)
    if config.method == "dpo":
        return DpoObjective(config.data, config.dpo, chunk, config.seed, packing=config.training.packing)
    if config.method == "reward_model":
        return RewardModelObjective(config.data, config.reward_model, chunk, config.seed,
                                    packing=config.training.packing)
    raise ValueError(f"{config.method!r} is not an offline method")


def run_offline(config: Config, objective: OfflineObjective | None = None,
                policy: LoadedModel | None = None, world: World = SINGLE) -> dict[str, Any]:
    objective = objective or make_objective(config)
    with prepared_run(config, world) as setup:
        policy = policy or getattr(objective, "load_model", load_policy)(config.model, config.lora,
                                                                        setup.precision.weight_dtype)
        train, evals, data_summary = objective.prepare(policy)  # also makes DPO's reference copy
        if data_summary:
            setup.run.update_summary(data_summary)
        # a distributed run shards what trains, and a frozen reference copy, across the ranks
        session = setup.session(policy, frozen=(getattr(objective, "reference", None),))
        return _train(config, objective, session, train, evals)


def _train(config: Config, objective: OfflineObjective, session: TrainingSession, train: TrainRows | list[Any],
           evals: list[Any]) -> dict[str, Any]:
    if not isinstance(train, TrainRows):  # an objective that reads one source itself
        train = TrainRows(train, ["train"], [0], [len(train)], config.seed, config.data.shuffle)
    policy = session.policy
    tc = config.training
    batch, micro = tc.batch_size, tc.micro_batch_size or tc.batch_size
    steps_per_epoch = math.ceil(len(train) / batch)
    total = steps_per_epoch * tc.epochs
    if tc.max_steps:
        total = min(total, tc.max_steps)
    cursor = BatchCursor()
    session.register("data", cursor)
    # eval.suites sample from the policy (its whole copy in a distributed run)
    suites = prepare_suites(config.eval.suites, policy.tokenizer, config.data.max_prompt_length,
                            config.data.on_invalid, config.scoring)
    suite_engine = build_engine(policy.unsharded(), config.seed, batch_size=config.eval.batch_size) if suites else None
    session.start(total, objective.progress_keys, objective.title)
    eval_metrics: dict[str, float] = {}
    try:
        # signal handlers while the loop runs, gone when it ends (an error included): see session.running
        with session.running():
            session.resume()
            model = policy.model
            model.train()

            def done() -> bool:
                return session.step >= total or session.stopping

            while cursor.epoch < tc.epochs and not done():
                epoch = cursor.epoch
                order = train.order(epoch)
                while cursor.epoch == epoch and not done():
                    b = cursor.batch
                    examples = [train.examples[i] for i in order[b * batch:(b + 1) * batch]]
                    metrics = _train_step(session, objective, model, examples, micro)
                    cursor.advance(steps_per_epoch)
                    if metrics is None:  # skipped: non-finite loss or gradient
                        continue
                    metrics["epoch"] = epoch + (b + 1) / steps_per_epoch
                    failed = None
                    if evals and session.eval_due():
                        session.sync_mirror()  # generation evals sample from the whole weights
                        with session.autocast():
                            eval_metrics, failed = evaluation(lambda: objective.evaluate(policy, evals), session.world)
                        metrics.update(eval_metrics)
                        model.train()
                    if suites and failed is None:
                        suite_metrics, failed = session.evaluate_suites(suite_engine, suites, config.seed)
                        metrics.update(suite_metrics)
                        eval_metrics.update(suite_metrics)
                        model.train()
                    session.log(metrics)
                    if failed is not None:
                        session.fail_evaluation(failed)
                    if session.checkpoint_due():
                        session.save_checkpoint()
            if evals and not session.stopping and session.step < total:  # ended early (skipped steps)
                session.sync_mirror()
                with session.autocast():
                    eval_metrics, failed = evaluation(lambda: objective.evaluate(policy, evals), session.world)
                session.log_eval(eval_metrics)
                if failed is not None:
                    session.fail_evaluation(failed)
    finally:
        session.close_display()
    train_metrics = _last_train_metrics(session)
    return session.finish({**train_metrics, **eval_metrics})


def _train_step(session: TrainingSession, objective: OfflineObjective, model: Any, examples: list[Any],
                micro: int) -> dict[str, float] | None:
    """One optimizer step over the global batch `examples`: this rank's share of it, in micro-batches,
    each loss divided by the whole batch's normaliser (so the ranks' gradients add up to it)."""
    start = time.perf_counter()
    world = session.world
    norm = objective.normaliser(examples)
    first, stop = world.share(len(examples))
    mine = examples[first:stop]
    chunks = [mine[i:i + micro] for i in range(0, len(mine), micro)]
    loss_total = 0.0
    parts = MetricAccumulator()
    # every rank runs as many micro-batches as the busiest (a sharded forward/backward is collective):
    # extra ones repeat a real chunk with a zero loss
    for i in range(int(world.max([len(chunks)])[0])):
        real = i < len(chunks)
        with session.autocast():
            loss, m = objective.loss(model, chunks[i] if real else (chunks or [examples[:1]])[0], norm)
        session.backward(loss * (loss_scale(world) if real else 0.0))
        if real:
            loss_total += float(loss.detach())
            parts.add(m)
    lr = session.lr
    applied, grad_norm = session.optimizer_step(loss_total)
    if not applied:
        return None
    session.step += 1
    elapsed = time.perf_counter() - start
    sums = parts.reduce(world).sums()
    loss_total = world.sum([loss_total])[0]
    out = {"loss": loss_total, "lr": lr, "grad_norm": grad_norm, "nonfinite_skipped": session.nonfinite_total,
           "step_time": elapsed, **sums}
    if "tokens" in sums:
        out["tokens_per_s"] = sums["tokens"] / elapsed
    return out


def _last_train_metrics(session: TrainingSession) -> dict[str, float]:
    records = [r for r in session.run.read_metrics() if "loss" in r]
    return {f"train/{k}": v for k, v in records[-1].items() if k in ("loss", "grad_norm")} if records else {}
