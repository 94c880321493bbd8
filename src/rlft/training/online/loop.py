"""The online loop (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, and PPO with a critic):

    prompts -> rollout -> rewards -> advantages -> mu epochs of policy updates -> metrics -> checkpoint

Presets only choose parts (advantage estimator, clip range, KL placement, aggregation); there is
one loop. Each step reads top to bottom in `online_step`.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from rlft.algorithms import (ADVANTAGE_ESTIMATORS, EPISODE_LEVEL, KL_ESTIMATORS, make_kl_controller, per_episode,
                             reverse_kl_advantages)
from rlft.config import Config, DataConfig
from rlft.data.mixing import TrainRows, read_train_rows
from rlft.data.order import PromptSampler
from rlft.data.prompts import PromptExample, make_prompt_encoder
from rlft.data.readers import read_rows
from rlft.data.validate import check_rows
from rlft.errors import ConfigError, EnvironmentFailed, RankStopped, RewardError, ServerError, TrainingHalted
from rlft.eval.generation import evaluate_prompts
from rlft.eval.suites import prepare_suites
from rlft.models.loading import Reference, disable_dropout, load_policy, resolve_device
from rlft.monitor.catalogue import STALENESS_SPLIT, staleness_key
from rlft.monitor.console import console
from rlft.monitor.checks import infra_error_message
from rlft.monitor.stats import world_sums
from rlft.rewards.calls import ScoringInterrupted
from rlft.rewards.scoring import RewardScorer, Scores, build_scorer
from rlft.rollout import Engine, build_engine, rollout_dtype, rollout_engine, sampling_params
from rlft.rollout.agent import agent_driver, reward_specs
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.contract import trained_segments
from rlft.rollout.hf import HFEngine
from rlft.rollout.sampler_process import ProcessEngine, use_process
from rlft.training.distributed import SINGLE, World, gather_rows
from rlft.training.host_memory import release_free_heap
from rlft.training.online.collect import Rollout
from rlft.training.online.critic import Critic, build_critic
from rlft.training.online.distill import Teacher, load_teacher
from rlft.training.online.rollouts import (AsyncRollouts, RolloutMaker, SamplerFailed, SharedScorer, SyncRollouts,
                                           check_async_ranks, sampler_copy)
from rlft.training.online.sft_mix import build_sft_mix
from rlft.training.online.update import UpdateSettings, policy_update, reference_logprobs, token_rewards
from rlft.training.session import TrainingSession, evaluation, prepared_run

PROGRESS_KEYS = ["reward/mean", "kl", "entropy", "completion/length_mean", "clip/high_frac", "eval/accuracy"]


def load_prompts(data: DataConfig, tokenizer: Any, source: str, split: str, kind: str,
                 required: tuple[str, ...] = (), agent: Any = None) -> list[PromptExample]:
    """Prompt rows, each checked (and `required` fields present: what the rewards read); `agent`
    the run's agent section (a verifiers environment's datasets are data sources)."""
    encode = make_prompt_encoder(tokenizer, data.max_prompt_length, required)
    return check_rows(read_rows(source, split, data.max_row_bytes, agent), encode, source, kind, data.on_invalid)


def run_online(config: Config, world: World = SINGLE, trim_heap: bool = True) -> dict[str, Any]:
    """`trim_heap`: hand the C heap's freed pages back to the OS between a step's phases (CPU; the
    memory fit turns it off when memory is plentiful, see training.host_memory)."""
    with prepared_run(config, world) as setup:
        precision = setup.precision
        sample_dtype = rollout_dtype(config.rollout.dtype, precision, resolve_device(config.model.device))
        if config.rollout.servers:  # every server reachable and serving this model, before weights load
            from rlft.rollout.servers.client import preflight  # lazy: httpx, an optional extra

            preflight(config.rollout.servers, config.rollout.server, config.model,
                      config.lora.r if config.lora.enabled and config.rollout.server.lora_sync == "adapter" else None)
        policy = load_policy(config.model, config.lora, precision.weight_dtype)
        disable_dropout(policy.model)  # on-policy, pi / pi_old must be exactly 1 (see rl_update)
        reference = Reference(policy) if config.needs_reference else None  # the starting weights
        teacher = load_teacher(config, policy.tokenizer, precision.weight_dtype) if config.teacher else None
        # a distributed run shards what trains, and the frozen reference and teacher, across the ranks
        session = setup.session(policy, frozen=(reference, teacher))
        return _train(config, session, reference, sample_dtype, teacher, trim_heap)


@dataclass
class Online:
    """What the online loop works with, built once from the config by `build_online`."""

    rollouts: SyncRollouts | AsyncRollouts  # the steps' scored rollouts
    engine: Engine  # evaluations sample with it (with rollout.async_steps = 0 the rollouts too)
    driver: Any  # the run's turn driver (agent episodes); evaluations sample its turns on `engine`
    scorer: Any  # evaluations' rewards
    train_rows: TrainRows
    evals: list[PromptExample]
    suites: list[Any]
    correct: str  # the component that decides correctness (per-source accuracy)
    kl_ctl: Any
    update_gen: torch.Generator
    settings: UpdateSettings
    critic: Critic | None
    sft_mix: Any
    total: int  # steps
    engines: list[Engine]  # everything to close at the end


def build_online(config: Config, session: TrainingSession, sample_dtype: torch.dtype | None = None) -> Online:
    """Data, rewards, engines, the rollout source and the update's parts, each checked; their state
    registered with the session (before its resume)."""
    a, d, sc, policy, world = config.algorithm, config.data, config.scoring, session.policy, session.world
    k = config.rollout.async_steps
    if k and world.active:
        check_async_ranks(config)
    scorer = _scorer(config, session)
    needs = scorer.required_fields
    train_rows = read_train_rows(d, config.seed, lambda path: load_prompts(d, policy.tokenizer, path, d.split,
                                                                           "prompt", needs, config.agent))
    prompts = train_rows.examples
    evals = load_prompts(d, policy.tokenizer, d.eval, d.eval_split or d.split, "eval prompt", needs,
                         config.agent) if d.eval else []
    suites = prepare_suites(config.eval.suites, policy.tokenizer, d.max_prompt_length, d.on_invalid, sc,
                            config.agent)
    sft_mix = build_sft_mix(config, policy.tokenizer, world)
    correct = config.eval.correct_component or scorer.components[0][0]
    components = [name for name, *_ in scorer.components]
    if train_rows.mixed and correct not in components:
        raise ConfigError(f"eval.correct_component {correct!r} (per-source accuracy) is not a reward component; "
                          f"choose one of {components}")
    engine, sample_engine, sampler_model = _engines(config, policy.unsharded(), sample_dtype, world,
                                                    session.run.root)
    # each rank runs its share's episodes (collect_rollout); evaluations run theirs on the loop's
    # thread, so on its engine (`driver.run(..., engine=)`), with the same driver
    driver = agent_driver(config.agent, sample_engine, policy.tokenizer,
                          [prompts, evals, *(p.examples for p in suites)], d.max_prompt_length, config.seed,
                          _stop_request(config, session))
    kl_ctl = make_kl_controller(a.kl_coef, a.kl_target, a.kl_adapt_factor, a.kl_controller, a.kl_horizon)
    sampler = PromptSampler(len(train_rows), config.seed, d.shuffle, order=train_rows.order)
    update_gen = torch.Generator().manual_seed(config.seed)
    total = config.training.max_steps or config.training.epochs * math.ceil(len(train_rows) /
                                                                          config.rollout.prompts_per_step)
    settings, params = UpdateSettings.from_config(config), sampling_params(config.rollout)
    critic = build_critic(config, session, settings, total) if a.advantage == "gae" else None
    if critic is not None:  # final/critic/, written with (and as whole as) the policy's export
        session.export_also(lambda final: critic.export(final / "critic"))
    maker = RolloutMaker(sample_engine, sampler, prompts, scorer, params, config.rollout.prompts_per_step,
                         a.dynamic_sampling, a.dynamic_sampling_max_rounds, world, driver)
    rollouts, eval_scorer = _rollout_source(k, maker, policy.unsharded().model, sampler_model, session.sync_mirror)

    for name, part in (*rollouts.parts().items(), ("kl", kl_ctl), ("update_generator", update_gen),
                       ("critic", critic), ("sft_mix", sft_mix)):
        if part is not None:  # batches sampled but not yet trained on survive only in an async run's queue
            session.register(name, _GeneratorState(part) if isinstance(part, torch.Generator) else part)
    return Online(rollouts, engine, driver, eval_scorer, train_rows, evals, suites, correct, kl_ctl, update_gen,
                  settings, critic, sft_mix, total, list({id(e): e for e in (sample_engine, engine)}.values()))


def _scorer(config: Config, session: TrainingSession) -> RewardScorer:
    return build_scorer(reward_specs(config.rewards, config.agent), config.scoring,
                        should_stop=_stop_request(config, session), warn=None)


def _stop_request(config: Config, session: TrainingSession) -> Any:
    """What rewards and environment calls poll while the loop waits on them: a Ctrl-C may cut the
    wait short in one process (ScoringInterrupted: the step is abandoned); ranks stop together at a
    step's end instead, and a sampler thread always finishes its batch (a checkpoint saves it)."""
    if session.world.active or config.rollout.async_steps:
        return None
    return lambda: session.stop_signal is not None


def _rollout_source(k: int, maker: RolloutMaker, trainer_model: Any, sampler_model: Any,
                    sync: Any) -> tuple[SyncRollouts | AsyncRollouts, Any]:
    """The rollouts of `maker`, in turn (k = 0) or from a sampler thread, which samples from
    `trainer_model`'s weights as `sync` brings them up to the trained ones (a distributed run's
    mirror); and the scorer evaluations use (async: the same rewards, each side's calls and
    reports taken under one lock)."""
    if not k:
        return SyncRollouts(maker), maker.scorer
    lock = threading.Lock()
    real = maker.scorer
    maker.scorer = SharedScorer(real, lock)
    return AsyncRollouts(maker, k, trainer_model, sampler_model, sync), SharedScorer(real, lock)


def _engines(config: Config, policy: Any, dtype: torch.dtype | None, world: World,
             run_root: Path) -> tuple[Engine, Engine, Any]:
    """(the engine evaluations use, the engine rollouts use, the module the rollout engine samples
    from). Synchronous: one engine on the trainer's own (unsharded) module. Async: the sampler's
    engine gets its own copy of the policy; evaluations sample the live weights on the loop's
    thread with the hf engine (a vLLM engine is the sampler thread's alone). rollout.sampler
    'process' (auto: on CPU in one process) moves the sampler's hf engine into a child process that
    samples from the copy's storages in shared memory (rollout/sampler_process.py). With
    rollout.servers rank 0 sends the weights, under version names every rank agrees on."""
    r = config.rollout
    servers = {}
    if r.servers and r.async_steps and world.active:
        raise ConfigError("rollout.servers with rollout.async_steps > 0 runs one trainer process for now: every "
                          "rank's sampler would need the servers on its own weight version at once. Train with one "
                          "process (the servers sample in parallel anyway), or set rollout.async_steps=0")
    if r.servers:
        servers = dict(push=world.main, version_prefix=world.broadcast(uuid.uuid4().hex[:8]),
                       adapter_dir=r.server.adapter_dir or run_root / "server-adapters")
    if not r.async_steps:
        engine = rollout_engine(r, policy, config.seed, dtype, **servers)
        return engine, engine, policy.model
    if r.engine == "vllm":
        copy_ = sampler_copy(policy, torch.device("cpu"), holds_only=True)
    else:
        copy_ = sampler_copy(policy, None if r.sampler_device == "auto" else
                             resolve_device(r.sampler_device, "rollout.sampler_device"))
    sample_engine = rollout_engine(r, copy_, config.seed, dtype, **servers)
    if isinstance(sample_engine, HFEngine) and use_process(r.sampler, copy_.device, world.active):
        sample_engine = ProcessEngine(sample_engine)
    engine = build_engine(policy, config.seed, "hf", r.batch_size, r.fast_decode, dtype=dtype)
    return engine, sample_engine, copy_.model


def _train(config: Config, session: TrainingSession, reference: Reference | None,
           sample_dtype: torch.dtype | None = None, teacher: Teacher | None = None,
           trim_heap: bool = True) -> dict[str, Any]:
    a, world = config.algorithm, session.world
    trim = release_free_heap if trim_heap else lambda device: None
    o = build_online(config, session, sample_dtype)
    rollouts, critic = o.rollouts, o.critic
    session.start(o.total, PROGRESS_KEYS, config.method, updates_per_step=a.epochs * a.minibatches)
    last: dict[str, float] = {}
    eval_metrics: dict[str, float] = {}
    try:
        # signal handlers while the loop runs, gone when it ends (an error included): see session.running
        with session.running():
            session.resume()
            rollouts.start(session.step)
            while session.step < o.total and not session.stopping:
                start = time.perf_counter()
                try:
                    rollout = rollouts.take()
                except ScoringInterrupted:  # Ctrl-C while rewards or an environment ran: finish() saves
                    rollouts.restore()  # the last completed step
                    break
                except (RewardError, EnvironmentFailed, SamplerFailed, RankStopped, ServerError) as exc:
                    _halt(session, rollouts, str(exc))
                trim(session.policy.device)  # the freed sampling buffers (CPU: see host_memory)
                _server_metrics(session, rollouts.maker.engine, rollout.metrics)
                rollout.metrics.update(world_sums(world, _scoring_report(session, rollout.scoring_report)))
                _check_infra(session, rollout, config.scoring.max_infra_error_rate, rollouts)
                metrics = online_step(session, rollout, reference, o.kl_ctl, o.settings, o.update_gen, critic,
                                      o.sft_mix, teacher)
                trim(session.policy.device)  # the update's freed activations
                session.sync_mirror()  # a distributed run's whole copy, which the engine samples from
                rollouts.trained()  # the engine (or the sampler thread) takes the new weights
                if metrics is None:  # every update was skipped (non-finite): draw a new batch
                    continue
                session.step += 1
                if o.train_rows.mixed:
                    metrics.update(_source_metrics(world, rollout, o.correct, config.eval.correct_threshold))
                texts = [t for part in world.gather([c.text for c in rollout.completions]) for t in part]
                metrics.update(session.monitor.completion_metrics(texts))
                metrics["time/step"] = time.perf_counter() - start
                metrics["tokens_per_s"] = metrics["completion/tokens"] / metrics["time/step"]
                failed = None
                if o.evals and session.eval_due():
                    eval_metrics, failed = _evaluate(session, o.engine, o.evals, config, o.scorer, o.driver)
                    metrics.update(eval_metrics)
                if o.suites and failed is None:
                    suite_metrics, failed = session.evaluate_suites(o.engine, o.suites, config.seed,
                                                                    metrics["reward/mean"], o.driver)
                    metrics.update(suite_metrics)
                    eval_metrics.update(suite_metrics)
                _log_samples(session, rollout, config.logging.num_samples, config.logging.sample_every)
                session.log(metrics)
                last = metrics
                if failed is not None:  # the step itself is complete: it is what the checkpoint holds
                    session.fail_evaluation(failed)
                if session.checkpoint_due():
                    session.save_checkpoint()
        train_summary = {f"train/{k}": v for k, v in last.items() if k in ("reward/mean", "kl", "entropy")}
        session.close_display()
        return session.finish({**train_summary, **eval_metrics})
    finally:
        session.close_display()
        rollouts.close(wait=sys.exc_info()[0] is None)  # the sampler thread is done with its engine
        # last: a vLLM engine tears down the process group it joined (in a distributed run, ours),
        # so every rank must be past its last collective first
        if world.active and sys.exc_info()[0] is None:
            world.barrier()
        for engine in o.engines:
            engine.close()


def online_step(session: TrainingSession, rollout: Rollout, reference: Reference | None, kl_ctl: Any,
                s: UpdateSettings, generator: torch.Generator, critic: Critic | None = None,
                sft_mix: Any = None, teacher: Teacher | None = None) -> dict[str, float] | None:
    """Advantages and policy updates for one scored rollout; returns the step's metrics. In a
    distributed run `rollout` is this rank's share; metrics and advantages are the global batch's."""
    world = session.world
    metrics = _rollout_metrics(session, rollout, kl_ctl.value)
    if not world.any(bool(rollout.completions)):
        return {**metrics, "update/skipped_no_signal": 1.0}
    start = time.perf_counter()
    device = session.policy.device
    batch = RolloutBatch.from_completions(rollout.completions, rollout.group_ids, session.policy.tokenizer.pad_token_id,
                                          device)
    valid = torch.tensor([r is not None for r in rollout.rewards], device=device)

    # KL to the reference on the sampled tokens: a loss term, or a penalty in the token rewards
    ref_lp = kl_tok = None
    if reference is not None:
        ref_start = time.perf_counter()
        with session.autocast():
            ref_lp = reference_logprobs(reference, batch, s.temperature, s.micro_batch_size, world, s.packing,
                                        s.shared_prefix)
        metrics["time/reference"] = time.perf_counter() - ref_start
        kl_tok = KL_ESTIMATORS[s.kl_estimator](batch.sampling_logprobs, ref_lp)  # [N, T]
        kl_sum, tokens = world.sum([float((kl_tok * batch.completion_mask).sum()), float(batch.completion_mask.sum())])
        metrics["kl"] = kl_sum / max(tokens, 1.0)
    beta = kl_ctl.value
    penalty = beta * kl_tok if (s.kl_in_reward and kl_tok is not None and beta > 0) else None
    rewards_tok = token_rewards(rollout.rewards, batch, penalty)  # [N, T]

    # advantages over the global batch (group baselines, batch whitening, GAE over the critic's
    # values): every rank computes the same, then keeps its rows
    with session.autocast():
        values = critic.values(batch, world) if critic is not None else None
    if teacher is not None:  # on-policy distillation: each token's own signal, from the teacher (no gather)
        advantages, adv_metrics = _distillation_advantages(session, teacher, batch, s)
        global_sequences = None
    else:
        global_rows, (first, stop) = gather_rows(world, rewards_tok, batch.completion_mask, batch.group_ids, valid,
                                                 _to_leader(rollout.completions, device),
                                                 *(() if values is None else (values,)))
        rewards_g, mask_g, groups_g, valid_g, to_leader_g = global_rows[:5]
        global_sequences = int(mask_g.shape[0])
        estimator = ADVANTAGE_ESTIMATORS[s.advantage]
        if critic is None and s.advantage in EPISODE_LEVEL and penalty is None and bool(to_leader_g.any()):
            # an agent program's episode trained as several sequences is one member of its group
            leader = torch.arange(global_sequences, device=device) + to_leader_g
            advantages_g, adv_metrics = per_episode(estimator, rewards_g, mask_g.bool(), groups_g, valid_g.bool(),
                                                    leader, std_floor=s.std_floor, gamma=s.gamma, lam=s.lam)
        elif critic is None:
            advantages_g, adv_metrics = estimator(
                rewards_g, mask_g.bool(), groups_g, valid_g.bool(), std_floor=s.std_floor, gamma=s.gamma, lam=s.lam)
        else:
            advantages_g, adv_metrics = critic.targets.gae_advantages(
                global_rows[5], mask_g.bool(), groups_g, rewards_g, valid_g.bool(), (first, stop))
        advantages = advantages_g[first:stop, : batch.completion_len]
    metrics.update(adv_metrics)

    # mu epochs x minibatches of clipped policy-gradient steps (the critic learns alongside)
    train_policy = critic is None or critic.trains_policy(session.step)
    update: dict[str, float] = {"update/optimizer_steps": 0.0}
    if train_policy:
        extra = critic.policy_term() if critic is not None else None
        update = policy_update(session, batch, advantages, ref_lp, beta, s, generator, extra, sft_mix)
        if update["update/optimizer_steps"] == 0 and "update/skipped_no_signal" not in update:
            return None
    if critic is not None:
        update.update(critic.update(session, batch, generator, policy_trained=train_policy))
    metrics.update(update)
    if s.split_staleness:
        metrics.update(by_staleness(metrics))
    metrics["nonfinite_skipped"] = float(session.nonfinite_total)
    if "kl" in metrics:  # measured on every sequence of the global batch
        kl_ctl.update(metrics["kl"], global_sequences if global_sequences is not None
                      else int(world.sum([batch.completion_mask.shape[0]])[0]))
    metrics["time/train"] = time.perf_counter() - start
    return metrics


def _to_leader(completions: list[Any], device: torch.device) -> torch.Tensor:
    """[N] long: for each row, how far back the first row of its episode is (0 unless an agent
    program's episode was split into several sequences, which share their Episode record; they are
    adjacent in one rank's rows, so the offset holds in the gathered batch too)."""
    first: dict[int, int] = {}
    out = [first.setdefault(id(c.episode), i) - i if c.episode is not None else 0 for i, c in enumerate(completions)]
    return torch.tensor(out, dtype=torch.long, device=device)


def by_staleness(metrics: dict[str, float]) -> dict[str, float]:
    """The step's mismatch and importance-weight metrics under its batch's staleness s
    (`rollout/staleness_<s>/...`): pacing by version gives every completion of a batch one version,
    so the batch's numbers are those of staleness s. (A rollout made outside the run's rollout
    source, as a test's oracle makes them, has no staleness measured: nothing to split.)"""
    if "rollout/staleness_max" not in metrics:
        return {}
    s = metrics["rollout/staleness_max"]
    if s != metrics["rollout/staleness_mean"]:
        raise AssertionError(f"a batch with mixed staleness (mean {metrics['rollout/staleness_mean']}, max {s})")
    return {staleness_key(int(s), key): metrics[key] for key in STALENESS_SPLIT if key in metrics}


def _distillation_advantages(session: TrainingSession, teacher: Teacher, batch: RolloutBatch,
                             s: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The teacher's log-probs on the sampled tokens, minus the student's sampling log-probs; the
    reverse KL metric is the global batch's mean per token."""
    world = session.world
    with session.autocast():
        teacher_lp = reference_logprobs(teacher, batch, s.temperature, s.micro_batch_size, world, s.packing,
                                        s.shared_prefix)
    advantages, _ = reverse_kl_advantages(batch.sampling_logprobs, teacher_lp, batch.completion_mask)  # [N, T]
    kl_sum, tokens = world.sum([float(-advantages.sum()), float(batch.completion_mask.sum())])
    return advantages, {"distill/reverse_kl": kl_sum / max(tokens, 1.0)}


def _rollout_metrics(session: TrainingSession, rollout: Rollout, beta: float) -> dict[str, float]:
    """The step's reward and length metrics over every rank's completions."""
    world = session.world
    local = (rollout.scores, [len(c.completion_ids) for c in rollout.completions],
             [c.finish_reason for c in rollout.completions])
    parts = world.gather(local)
    scores = Scores.concat([p[0] for p in parts])
    lengths = [n for p in parts for n in p[1]]
    finishes = [f for p in parts for f in p[2]]
    metrics: dict[str, float] = {**scores.metrics(), **rollout.metrics}
    metrics["reward/infra_error_rate"] = metrics.pop("reward/unverifiable_frac")
    n = max(len(lengths), 1)
    metrics.update({"completion/length_mean": sum(lengths) / n, "completion/length_max": float(max(lengths, default=0)),
                    "completion/truncation_rate": sum(f == "length" for f in finishes) / n,
                    "completion/tokens": float(sum(lengths)), "lr": session.lr, "beta": beta})
    return metrics


def _source_metrics(world: World, rollout: Rollout, correct: str, threshold: float) -> dict[str, float]:
    """Mixed data sources: each source's mean reward and accuracy (its `correct` component at or
    above `threshold`) over the step's completions of its prompts, on every rank."""
    local = [(e.source, total, value) for e, total, value in
             zip(rollout.examples, rollout.scores.total, rollout.scores.components.get(correct, []))]
    by_source: dict[str, list[tuple[float | None, float | None]]] = {}
    for part in world.gather(local):
        for source, total, value in part:
            by_source.setdefault(source, []).append((total, value))
    out: dict[str, float] = {}
    for source, rows in sorted(by_source.items()):
        totals = [t for t, _ in rows if t is not None]
        out[f"reward/source/{source}"] = sum(totals) / len(totals) if totals else float("nan")
        out[f"accuracy/source/{source}"] = sum(v is not None and v >= threshold for _, v in rows) / len(rows)
        out[f"data/source/{source}_frac"] = len(rows) / sum(len(r) for r in by_source.values())
    return out


def _check_infra(session: TrainingSession, rollout: Rollout, limit: float,
                 rollouts: SyncRollouts | AsyncRollouts) -> None:
    total = [r for rewards in session.world.gather(rollout.rewards) for r in rewards]
    rate = sum(r is None for r in total) / max(len(total), 1)
    if rate > limit:
        rollouts.restore()
        path = session.save_checkpoint() if session.step > 0 else None
        raise TrainingHalted(infra_error_message(session.step + 1, rate, limit, path))


def _scoring_report(session: TrainingSession, report: tuple[dict[str, float], list[str]],
                    prefix: str = "") -> dict[str, float]:
    """The step's reward/timeouts and reward/errors; one console line per reward that misbehaved."""
    metrics, warnings = report
    for line in warnings:
        session.print(f"[yellow]warning: {prefix}{escape(line)}")
    return metrics


def _evaluate(session: TrainingSession, engine: Any, evals: list[PromptExample], config: Config,
              scorer: RewardScorer, driver: Any = None) -> tuple[dict[str, float], str | None]:
    """Held-out metrics after a step (of episodes, with a turn `driver`), and why they failed, if
    they did. A Ctrl-C during the eval's scoring ends it without metrics (the loop then stops, the
    step is kept)."""
    metrics, failed = evaluation(lambda: evaluate_prompts(engine, evals, config.eval, scorer, seed=config.seed,
                                                          driver=driver).metrics, session.world)
    if failed is None:
        _scoring_report(session, scorer.take_report(), prefix="eval: ")
    return metrics, failed


def _server_metrics(session: TrainingSession, engine: Engine, metrics: dict[str, float]) -> None:
    """rollout.servers: the last push's seconds (time/weight_sync); on the first step, how the
    weights travel (a line on the console: the transfer backend is chosen at the first push)."""
    pushes = getattr(engine, "sync_seconds", None)
    if not pushes:
        return
    metrics["time/weight_sync"] = pushes[-1]
    if session.step == 0 and session.world.main:
        console.print(f"rollout servers: {escape(engine.describe())}", highlight=False)


def _halt(session: TrainingSession, rollouts: SyncRollouts | AsyncRollouts, message: str) -> None:
    """Stop the run on a reward, environment or sampler failure, saving the last completed step
    (its state as it was when that step ended: the abandoned step's rollout is undone first)."""
    rollouts.restore()
    path = session.save_checkpoint() if session.step > 0 else None
    saved = (f"\nThe last completed step ({session.step}) is saved in {path}; after the fix, continue with: "
             f"rlft train --resume {session.run.root}") if path else ""
    raise TrainingHalted(f"stopped: {message}{saved}")


def _log_samples(session: TrainingSession, rollout: Rollout, num_samples: int, every: int) -> None:
    if not num_samples or session.step % every:
        return
    records = []
    for i in range(min(num_samples, len(rollout.completions))):
        c, e = rollout.completions[i], rollout.examples[i]
        records.append({"step": session.step, "where": e.where, "prompt": e.prompt_text, "completion": c.text,
                        "reward": rollout.rewards[i], "finish_reason": c.finish_reason,
                        "components": {k: v[i] for k, v in rollout.scores.components.items()}})
        if rollout.scores.info:  # notes of rewards (a judge's reply, an ensemble's members)
            records[-1]["info"] = rollout.scores.sample_info(i)
        episode = getattr(c, "episode", None)
        if episode is not None:  # a multi-turn episode: its assistant and tool turns, in order
            transcript = episode.messages[len(e.messages):]
            records[-1].update(transcript=transcript, turns=episode.turns, tool_calls=episode.tool_calls,
                               segments=trained_segments(c, session.policy.tokenizer.decode, transcript))
        if episode is not None and episode.env_rewards is not None:  # the prompt may be its first observation
            records[-1].update(prompt=episode.messages[len(e.messages) - 1]["content"], env_rewards=episode.env_rewards,
                               env_done=episode.env_done, env_final=episode.env_final)
    session.log_samples(records)
    if records:
        r = records[0]
        reward = "unverifiable" if r["reward"] is None else f"{r['reward']:.3g}"
        # model text is escaped: a completion holding "[/]" must not be read as console markup
        session.print(f"[dim]step {session.step} sample (reward {reward}): {escape(repr(r['prompt'][:60]))} -> "
                      f"{escape(repr(r['completion'][:100]))}")


class _GeneratorState:
    """A torch.Generator as a checkpointed state part."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])

