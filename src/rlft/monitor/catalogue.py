"""The metric names a run logs, known before it starts, so settings that name a metric
(`checkpoint.keep_best`, `monitor.early_stop.metric`) are checked at start-up instead of failing
(or silently never firing) hours later. Tests check every key a real run logs is listed here."""

from __future__ import annotations

import difflib
from typing import Any

from rlft.errors import ConfigError
from rlft.models.loading import resolve_device
from rlft.rollout.agent.verifiers_env import reward_specs

_STEP = ("step", "lr", "grad_norm", "loss", "nonfinite_skipped")
_ONLINE = (
    "reward/mean", "reward/std", "reward/infra_error_rate", "reward/timeouts", "reward/errors",
    "completion/length_mean", "completion/length_max",
    "completion/truncation_rate", "completion/tokens", "completion/repetition_rate", "beta", "entropy",
    "adv/zero_std_group_frac", "adv/mean", "adv/std", "adv/max", "adv/min", "clip/low_frac", "clip/high_frac",
    "clip/dual_frac", "ratio/mean", "ratio/max", "ratio/min", "policy/approx_kl", "update/optimizer_steps",
    "update/skipped_no_signal", "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/ratio_mean",
    "rollout/staleness_mean", "rollout/staleness_max",
    "time/generate", "time/score", "time/train", "time/step", "time/rollout_wait", "tokens_per_s")
_ONLINE_IF = {
    "kl": ("kl", "time/reference"),
    "tis": ("rollout/tis_weight_mean", "rollout/tis_capped_frac"),
    "dynamic_sampling": ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups", "dynamic_sampling/kept_groups",
                         "dynamic_sampling/reward_mean_before_filter"),
    "critic": ("value/loss", "value/clip_frac", "value/mse", "value/mean", "value/returns_mean", "critic/grad_norm"),
}
# async runs: the mismatch and importance-weight metrics again under the batch's staleness
STALENESS_SPLIT = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/ratio_mean",
                   "rollout/tis_weight_mean", "rollout/tis_capped_frac")


def staleness_key(staleness: int, key: str) -> str:
    """rollout/logprob_diff_mean at staleness 1 -> rollout/staleness_1/logprob_diff_mean."""
    return f"rollout/staleness_{staleness}/{key.removeprefix('rollout/')}"


# What a metric measures where the name alone leaves it open, or frameworks differ on it.
METRIC_DESCRIPTIONS = {
    "policy/approx_kl": "How far the update moved the policy: KL(pi_old || pi) per token on the sampled tokens, "
                        "the k3 estimator (r - 1) - log r with r = pi / pi_old (Schulman's note), averaged over "
                        "the step's updates; >= 0. veRL's ppo_kl is k1 (mean of log pi_old - log pi), which can "
                        "be negative: compare the two only when both are small.",
    "rollout/staleness_mean": "Batches the trainer had trained on since the step's completions were sampled "
                              "(rollout.async_steps k: min(step - 1, k), exactly; 0 in a synchronous run). An "
                              "async run logs its engine/trainer mismatch (logprob_diff_mean|max, ratio_mean) and "
                              "tis weights (tis_weight_mean, tis_capped_frac) again as rollout/staleness_<s>/... "
                              "for the batch's staleness s (a batch's completions share one policy version): "
                              "s = 0 is the engine's own mismatch, s = k adds k updates of policy drift.",
    "time/rollout_wait": "Seconds the step waited for its rollouts: sampling and scoring them in a synchronous "
                         "run, the wait on the sampler thread's queue in an async one (whose time/sampler_wait "
                         "is how long the sampler waited for the weights the batch needed).",
    "time/reference": "Seconds of the step spent on the reference model's log-probs (part of time/train).",
    "time/weight_sync": "rollout.servers: seconds the last push of the trainer's weights to the servers took (the "
                        "transfer to every live server, its version set; async: the sampler's push for this batch).",
    "kl": "KL(pi || reference) per token on the sampled tokens, with algorithm.kl_estimator (k1, k2 or k3), "
          "measured before the step's update; what an adaptive beta steers toward algorithm.kl_target.",
}
_GENERATION_EVAL = ("eval/format_compliance", "eval/length_mean", "eval/truncation_rate", "eval/num_prompts")
_REWARD_EVAL = ("eval/reward_mean", "eval/accuracy", "eval/pass@1")
_OFFLINE = ("step_time", "tokens", "tokens_per_s", "epoch")
_BY_METHOD = {
    "sft": ((), ("eval/loss", "eval/perplexity") + _GENERATION_EVAL),
    "dpo": (("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
             "logps/rejected", "nll/chosen"),
            ("eval/loss", "eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margin",
             "eval/rewards/accuracy", "eval/logps/chosen", "eval/logps/rejected", "eval/nll/chosen")),
    "reward_model": (("rm/accuracy", "rm/margin", "scores/chosen", "scores/rejected"),
                     ("eval/loss", "eval/accuracy", "eval/margin", "eval/score_mean", "eval/score_std",
                      "eval/prefers_longer")),
}


def metric_names(config: Any, components: list[str]) -> tuple[set[str], tuple[str, ...]]:
    """(names a run of `config` logs, prefixes under which further names appear) -- the prefixes
    cover the parts of dict-valued rewards (`reward/<component>/<part>`), known only at run time."""
    names, prefixes = set(_STEP), []
    names.update(("loss_scale",) if config.training.precision == "fp16-mixed" else ())  # GradScaler's scale
    has_eval = bool(config.data.eval)
    prefixes += [f"eval/{suite.name}/" for suite in config.eval.suites]  # accuracy, pass@k, maj@k, ...
    if config.is_online:
        a = config.algorithm
        names.update(_ONLINE)
        names.update(("sft_mix/nll",) if a.sft_mix else ())
        if not isinstance(config.data.train, str):  # mixed sources: reward/accuracy/share per source
            prefixes += ["reward/source/", "accuracy/source/", "data/source/"]
        names.update(f"reward/{c}" for c in components)
        # an ensemble's disagreement in the total's units (reward/<c>/disagreement is under the prefixes)
        names.update(("reward/disagreement",) if any(r.fn == "reward_model_ensemble" for r in config.rewards) else ())
        prefixes += [f"reward/{c}/" for c in components]
        names.update(_ONLINE_IF["kl"] if config.needs_reference else ())
        names.update(_ONLINE_IF["tis"] if a.rollout_correction == "tis" else ())
        if config.rollout.servers:
            names.add("time/weight_sync")
        if config.rollout.async_steps:
            names.add("time/sampler_wait")
            split = STALENESS_SPLIT[:3] + (STALENESS_SPLIT[3:] if a.rollout_correction == "tis" else ())
            names.update(staleness_key(s, key) for s in range(config.rollout.async_steps + 1) for key in split)
        names.update(_ONLINE_IF["dynamic_sampling"] if a.dynamic_sampling else ())
        names.update(_ONLINE_IF["critic"] if a.advantage == "gae" else ())
        if has_eval:
            names.update(_GENERATION_EVAL + _REWARD_EVAL + (f"eval/pass@{config.eval.num_samples}",))
        if config.agent is not None:  # episodes: agent/... and env/... per step, under every eval's prefix too
            prefixes += ["agent/", "env/"] + (["eval/agent/", "eval/env/"] if has_eval else [])
        return names, tuple(prefixes)
    train_keys, eval_keys = _BY_METHOD[config.method]
    names.update(_OFFLINE + train_keys)
    if has_eval:
        names.update(eval_keys)
        if config.method == "sft" and components:
            names.update(_REWARD_EVAL + (f"eval/pass@{config.eval.num_samples}",))
    return names, tuple(prefixes)


def check_metric_setting(setting: str, name: str | None, config: Any, components: list[str]) -> None:
    """ConfigError when `name` (the value of `setting`) is not a metric this run logs."""
    if name is None:
        return
    names, prefixes = metric_names(config, components)
    if name in names or name.startswith(prefixes):
        return
    guess = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    hint = f" Did you mean {guess[0]!r}?" if guess else ""
    needs_eval = name.startswith("eval/") and not config.data.eval
    why = " (eval/ metrics need held-out data: set data.eval)" if needs_eval else ""
    raise ConfigError(f"{setting}={name!r} is not a metric this {config.method} run logs{why}.{hint}\n"
                      f"Metrics it logs: {', '.join(sorted(names))}")


def logged_only_part(specs: list[Any], name: str | None) -> str | None:
    """Why `name` (eval.correct_component) cannot count an answer correct when it names an entry
    that a program reward only logs (`args.log_others`: a verifiers 0.4 taskset's scores), or None."""
    head, sep, part = (name or "").partition("/")
    for spec in specs:
        if sep and spec.component == head and spec.fn == "program" and (spec.args or {}).get("log_others"):
            return (f"eval.correct_component={name!r}: {head!r} only logs {part!r} beside its value (args.log_others), "
                    "so it is no part of a reward to count answers by.\nFix: add it as a component of its own and "
                    f"name that: rewards: [{{fn: program, name: {head}, args: {{key: {spec.args.get('key')}, "
                    f"log_others: true}}}}, {{fn: program, name: {part}, weight: 0, args: {{key: {part}}}}}] and "
                    f"eval.correct_component: {part}")
    return None


def preflight(config: Any) -> None:
    """Settings that are only read late in a run (the evaluation, the best-checkpoint metric,
    early stopping), checked before the first step so a typo costs seconds, not a run."""
    specs = reward_specs(config.rewards, config.agent)
    components = [spec.component for spec in specs]
    name = config.eval.correct_component
    problem = logged_only_part(specs, name)
    if problem is not None:
        raise ConfigError(problem)
    if name is not None:
        if not components:
            raise ConfigError(f"eval.correct_component={name!r}, but the run has no rewards to score the evaluation "
                              "with.\nFix: add rewards (e.g. rewards: [{fn: math, name: correct}]) or drop it")
        if name not in components and name.split("/", 1)[0] not in components:
            guess = difflib.get_close_matches(name, components, n=1, cutoff=0.5)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
            raise ConfigError(f"eval.correct_component={name!r} is not a reward component of this run "
                              f"(components: {', '.join(components)}; a dict reward's part is written "
                              f"'<component>/<part>').{hint}")
    check_metric_setting("checkpoint.keep_best", config.checkpoint.keep_best, config, components)
    check_metric_setting("monitor.early_stop.metric", config.monitor.early_stop.metric, config, components)
    if config.is_online and config.rollout.sampler_device != "auto":  # used once the policy has loaded
        resolve_device(config.rollout.sampler_device, "rollout.sampler_device")
