"""The online loop (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, and PPO with a critic):

    prompts -> rollout -> rewards -> advantages -> mu epochs of policy updates -> metrics -> checkpoint

Presets only choose parts (advantage estimator, clip range, KL placement, aggregation); there is
one loop. Each step reads top to bottom in `online_step`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from rich.markup import escape

from rlft.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, make_kl_controller, whiten
from rlft.config import Config
from rlft.data.loading import read_rows
from rlft.data.prompts import PromptExample, make_prompt_encoder
from rlft.data.validate import check_rows
from rlft.errors import TrainingHalted
from rlft.eval.generation import evaluate_prompts
from rlft.models.loading import Reference
from rlft.rewards.base import RewardScorer
from rlft.rollout import build_engine, sampling_params
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.hf import generation_stop_ids
from rlft.train.critic import build_critic
from rlft.train.rl_update import (UpdateSettings, ValueTargets, critic_values, policy_update, reference_logprobs,
                                  token_rewards)
from rlft.train.rollouts import PromptSampler, Rollout, collect_rollout
from rlft.train.session import TrainingSession

PROGRESS_KEYS = ["reward/mean", "kl", "entropy", "completion/length_mean", "clip/high_frac", "eval/accuracy"]
RATIO_DRIFT = 1.3  # seed 002 §4.3: a mean importance ratio above this means off-policy training


def load_prompts(config: Config, tokenizer: Any, source: str, split: str, kind: str,
                 required: tuple[str, ...] = ()) -> list[PromptExample]:
    """Prompt rows, each checked (and `required` fields present: what the rewards read)."""
    encode = make_prompt_encoder(tokenizer, config.data.max_prompt_length, required)
    return check_rows(read_rows(source, split), encode, source, kind, config.data.on_invalid)


def update_settings(config: Config) -> UpdateSettings:
    a = config.algorithm
    return UpdateSettings(
        temperature=config.rollout.temperature, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
        kl_estimator=a.kl_estimator, kl_in_loss=a.kl_in == "loss", entropy_coef=a.entropy_coef,
        loss_agg=a.loss_agg, loss_constant=a.loss_constant, epochs=a.epochs, minibatches=a.minibatches,
        micro_batch_size=a.micro_batch_size, mask_truncated=a.mask_truncated)


def run_online(config: Config) -> dict[str, Any]:
    session = TrainingSession(config)
    policy, a = session.policy, config.algorithm
    end_ids = generation_stop_ids(policy.model, policy.tokenizer)
    scorer = RewardScorer(config.rewards, config.scoring.max_workers)
    needs = scorer.required_fields
    prompts = load_prompts(config, policy.tokenizer, config.data.train, config.data.split, "prompt", needs)
    evals = (load_prompts(config, policy.tokenizer, config.data.eval, config.data.eval_split or config.data.split,
                          "eval prompt", needs) if config.data.eval else [])
    engine = build_engine(config.rollout, policy, end_ids, config.seed)
    reference = Reference(policy) if (a.kl_coef > 0 or a.kl_target is not None) else None
    kl_ctl = make_kl_controller(a.kl_coef, a.kl_target, a.kl_adapt_factor)
    sampler = PromptSampler(len(prompts), config.seed, config.data.shuffle)
    update_gen = torch.Generator().manual_seed(config.seed)
    total = config.training.max_steps or config.training.epochs * math.ceil(len(prompts) / config.rollout.prompts_per_step)

    updates = a.epochs * a.minibatches
    critic = build_critic(config, session, total * updates) if a.advantage == "gae" else None

    session.start(total, PROGRESS_KEYS, config.method, updates_per_step=updates)
    # No rollout buffer survives a step: after a resume the next batch is generated afresh.
    session.extra_state = lambda: {"sampler": sampler.state_dict(), "kl": kl_ctl.state_dict(),
                                   "engine": engine.state_dict(), "update_generator": update_gen.get_state(),
                                   "rollout_buffer": "regenerated",
                                   "critic": critic.state_dict() if critic is not None else None}
    state = session.resume()
    if state is not None:
        sampler.load_state_dict(state["sampler"])
        kl_ctl.load_state_dict(state["kl"])
        engine.load_state_dict(state["engine"])
        update_gen.set_state(state["update_generator"])
        if critic is not None:
            critic.load_state_dict(state["critic"])

    settings, params = update_settings(config), sampling_params(config.rollout)
    last: dict[str, float] = {}
    eval_metrics: dict[str, float] = {}
    try:
        while session.step < total and session.stop_signal is None:
            start = time.perf_counter()
            rollout = collect_rollout(engine, sampler, prompts, scorer, params, config.rollout.prompts_per_step,
                                      a.dynamic_sampling, a.dynamic_sampling_max_rounds)
            _check_infra(session, rollout)
            metrics = online_step(session, rollout, reference, kl_ctl, settings, update_gen, critic)
            if metrics is None:  # every update was skipped (non-finite): draw a new batch
                continue
            session.step += 1
            metrics["time/step"] = time.perf_counter() - start
            metrics["tokens_per_s"] = metrics["completion/tokens"] / metrics["time/step"]
            if evals and session.eval_due():
                eval_metrics = evaluate_prompts(engine, evals, config.eval, scorer, seed=config.seed).metrics
                metrics.update(eval_metrics)
            _log_samples(session, rollout)
            session.log(metrics)
            last = metrics
            if session.checkpoint_due():
                session.save_checkpoint()
    finally:
        session.close_display()
    train_summary = {f"train/{k}": v for k, v in last.items() if k in ("reward/mean", "kl", "entropy")}
    summary = session.finish({**train_summary, **eval_metrics})
    if critic is not None and summary["status"] == "completed":
        critic.export(session.run.final / "critic")
    return summary


def online_step(session: TrainingSession, rollout: Rollout, reference: Reference | None, kl_ctl: Any,
                s: UpdateSettings, generator: torch.Generator, critic: Any = None) -> dict[str, float] | None:
    """Advantages and policy updates for one scored rollout; returns the step's metrics."""
    metrics = _rollout_metrics(session, rollout, kl_ctl.value)
    if not rollout.completions:
        return {**metrics, "update/skipped_no_signal": 1.0}
    start = time.perf_counter()
    a, device = session.config.algorithm, session.policy.device
    batch = RolloutBatch.from_completions(rollout.completions, rollout.group_ids, session.policy.tokenizer.pad_token_id,
                                          device)
    valid = torch.tensor([r is not None for r in rollout.rewards], device=device)
    ref_lp = kl_tok = None
    if reference is not None:
        ref_lp = reference_logprobs(reference, batch, s.temperature, a.micro_batch_size)
        kl_tok = KL_ESTIMATORS[a.kl_estimator](batch.sampling_logprobs, ref_lp)  # [N, T]
        metrics["kl"] = float((kl_tok * batch.completion_mask).sum() / batch.completion_mask.sum().clamp(min=1))
    beta = kl_ctl.value
    penalty = beta * kl_tok if (a.kl_in == "reward" and kl_tok is not None and beta > 0) else None
    rewards_tok = token_rewards(rollout.rewards, batch, penalty)  # [N, T]
    advantages, value = _advantages(session, batch, rewards_tok, valid, critic, metrics)
    update = policy_update(session, batch, advantages, ref_lp, beta, s, generator, value)
    if update["update/optimizer_steps"] == 0 and "update/skipped_no_signal" not in update:
        return None
    metrics.update(update)
    metrics["nonfinite_skipped"] = float(session.nonfinite_total)
    if "kl" in metrics:
        kl_ctl.update(metrics["kl"])
    metrics["time/train"] = time.perf_counter() - start
    if metrics.get("ratio/mean", 1.0) > RATIO_DRIFT:
        session.print(f"[yellow]warning: mean importance ratio {metrics['ratio/mean']:.2f} > {RATIO_DRIFT}: the rollout "
                      "weights drift from the trained weights (off-policy); check engine weight sync")
    return metrics


def _rollout_metrics(session: TrainingSession, rollout: Rollout, beta: float) -> dict[str, float]:
    metrics: dict[str, float] = {**rollout.scores.metrics(), **rollout.metrics}
    metrics["reward/infra_error_rate"] = metrics.pop("reward/unverifiable_frac")
    lengths = [len(c.completion_ids) for c in rollout.completions]
    n = max(len(lengths), 1)
    metrics.update({"completion/length_mean": sum(lengths) / n, "completion/length_max": float(max(lengths, default=0)),
                    "completion/truncation_rate": sum(c.finish_reason == "length" for c in rollout.completions) / n,
                    "completion/tokens": float(sum(lengths)), "lr": session.lr, "beta": beta})
    return metrics


def _advantages(session: TrainingSession, batch: RolloutBatch, rewards_tok: torch.Tensor, valid: torch.Tensor,
                critic: Any, metrics: dict[str, float]) -> tuple[torch.Tensor, ValueTargets | None]:
    """The configured estimator's advantages; for PPO, GAE over the critic's values, with the
    returns as the critic's targets and (optionally) whitened advantages for the policy."""
    config = session.config
    a = config.algorithm
    value = None
    if critic is not None:
        old_values = critic_values(critic, session.policy.model, batch, a.micro_batch_size)
        value = ValueTargets(critic, old_values, old_values, config.critic.value_clip, config.critic.value_coef,
                             train_policy=session.step >= config.critic.warmup_steps)
    advantages, adv_metrics = ADVANTAGE_ESTIMATORS[a.advantage](
        rewards_tok, batch.completion_mask, batch.group_ids, valid, std_floor=a.std_floor, gamma=a.gamma, lam=a.lam,
        values=value.old_values if value else None)
    metrics.update(adv_metrics)
    if value is not None:
        value.returns = advantages + value.old_values * batch.completion_mask
        if config.critic.whiten_advantages:
            advantages = whiten(advantages, batch.completion_mask & valid[:, None], std_floor=a.std_floor)
        metrics["value/returns_mean"] = float(value.returns[batch.completion_mask].mean())
    return advantages, value


def _check_infra(session: TrainingSession, rollout: Rollout) -> None:
    total = rollout.rewards
    rate = sum(r is None for r in total) / max(len(total), 1)
    limit = session.config.scoring.max_infra_error_rate
    if rate > limit:
        path = session.save_checkpoint() if session.step > 0 else None
        raise TrainingHalted(
            f"stopped at step {session.step + 1}: {rate:.0%} of rewards could not be computed (None), above "
            f"scoring.max_infra_error_rate={limit}. This is a reward infrastructure or data problem (a sandbox "
            f"that cannot start, malformed tests), not a wrong answer."
            + (f" Last state saved to {path}." if path else "")
            + "\nFix: check the reward setup with `rlft sandbox run` on one row, or raise the threshold")


def _log_samples(session: TrainingSession, rollout: Rollout) -> None:
    cfg = session.config.logging
    if not cfg.num_samples or session.step % cfg.sample_every:
        return
    records = []
    for i in range(min(cfg.num_samples, len(rollout.completions))):
        c, e = rollout.completions[i], rollout.examples[i]
        records.append({"step": session.step, "where": e.where, "prompt": e.prompt_text, "completion": c.text,
                        "reward": rollout.rewards[i], "finish_reason": c.finish_reason,
                        "components": {k: v[i] for k, v in rollout.scores.components.items()}})
    session.run.log_samples(records)
    if records:
        r = records[0]
        reward = "unverifiable" if r["reward"] is None else f"{r['reward']:.3g}"
        # model text is escaped: a completion holding "[/]" must not be read as console markup
        session.print(f"[dim]step {session.step} sample (reward {reward}): {escape(repr(r['prompt'][:60]))} -> "
                      f"{escape(repr(r['completion'][:100]))}")
