"""Settings of the health monitor (the `monitor:` config section) and of the logging backends.

Each detector has its own sub-section whose fields are exactly the keyword arguments of its
function in `rlft.monitor.detectors`, so the defaults live here once, each with the reason for its
value in its description (shown by `rlft config-help`). Fields named `metric`, `*_metric` or
`metrics` name the metrics.jsonl keys a detector reads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlft.config.section import Section

DetectorName = Literal["reward_hacking", "length_drift", "repetition", "kl", "entropy_collapse", "ratio_drift",
                       "clip_fraction", "zero_variance", "truncation", "tool_errors", "infra_errors",
                       "reward_disagreement"]
DETECTOR_NAMES: tuple[str, ...] = DetectorName.__args__  # type: ignore[attr-defined]  (== DETECTORS' keys)


class RewardHackingSettings(Section):
    reward_metric: str = Field("reward/mean", description="Train reward key.")
    eval_metric: str = Field("eval/accuracy", description="Held-out metric key (logged at eval steps).")
    eval_mode: Literal["max", "min"] = Field(
        "max", description="eval_metric is better when larger (max: accuracy) or smaller (min: loss).")
    window: int = Field(3, ge=2, description="Evals compared; fewer cannot tell a trend from held-out noise.")
    min_reward_rise: float = Field(
        0.1, description="Train reward rise that counts: a tenth of a 0-1 reward is beyond step-to-step noise.")
    max_eval_gain: float = Field(
        0.01, description="Held-out gain still called flat: one point of accuracy over the window.")


METRIC = "metrics.jsonl key this detector reads."
BASELINE = "Records averaged for the starting value (the SFT policy at step 0/1)."
SMOOTH = "The current value is the mean of the last N records with the metric."


class LengthDriftSettings(Section):
    metric: str = Field("completion/length_mean", description=METRIC)
    baseline: int = Field(1, ge=1, description=BASELINE)
    smooth: int = Field(3, ge=1, description=SMOOTH + " Per-batch lengths are noisy.")
    max_drift: float = Field(
        0.15, gt=0, description="Relative change from the starting length; beyond 15% is a reward-hacking sign.")
    growth_window: int = Field(5, ge=1, description="Records over which fast growth is measured.")
    max_growth: float = Field(
        0.1, gt=0, description="Relative growth within growth_window: +10% in 5 steps passes 15% in a few more.")


class RepetitionSettings(Section):
    metric: str = Field("completion/repetition_rate", description=METRIC)
    baseline: int = Field(1, ge=1, description=BASELINE)
    smooth: int = Field(3, ge=1, description=SMOOTH)
    max_rate: float = Field(
        0.3, ge=0, description="Repetition rate that fires: natural answers repeat almost no word 3-gram.")
    max_rise: float = Field(
        0.1, ge=0, description="Rise over the start that fires: ten points above the SFT policy.")


class KlSettings(Section):
    metric: str = Field("kl", description=METRIC)
    smooth: int = Field(3, ge=1, description=SMOOTH)
    max_kl: float = Field(
        0.5, gt=0, description="Ceiling on per-token KL to the reference (nats); GRPO at beta=0.04 stays near 0.1.")
    growth_window: int = Field(5, ge=1, description="Records in each of the two windows compared for growth.")
    max_growth: float = Field(
        3.0, gt=1, description="Ratio of consecutive window means that fires: tripling is a blow-up, not drift.")
    min_kl: float = Field(0.05, ge=0, description="Growth is ignored below this: KL rising from ~0 early is normal.")


class EntropyCollapseSettings(Section):
    metric: str = Field("entropy", description=METRIC)
    baseline: int = Field(1, ge=1, description=BASELINE)
    smooth: int = Field(3, ge=1, description=SMOOTH)
    min_entropy: float = Field(
        0.05, ge=0, description="Token entropy floor (nats): below it sampling is near-greedy, groups stop differing.")
    max_drop: float = Field(0.75, gt=0, le=1, description="Fraction of the starting entropy lost that fires.")


class RatioDriftSettings(Section):
    metrics: list[str] = Field(
        default_factory=lambda: ["rollout/ratio_mean"],
        description="Mean importance ratio keys; the first one logged is used. rollout/ratio_mean is the "
                    "trainer-to-engine ratio measured before any update, so the intended drift of later "
                    "epochs and minibatches (ratio/mean) does not count.")
    max_metric: str = Field("ratio/max", description="Largest token importance ratio of the step.")
    smooth: int = Field(1, ge=1, description=SMOOTH + " One off-policy step is already worth a look.")
    max_mean: float = Field(1.3, gt=1, description="Mean ratio above ~1.3 means training is off-policy.")
    max_max: float = Field(
        10.0, gt=1, description="Largest ratio that fires: a token 10x likelier under the trained weights.")


class ClipFractionSettings(Section):
    high_metric: str = Field("clip/high_frac", description="Share of tokens clipped above 1 + clip_high.")
    low_metric: str = Field("clip/low_frac", description="Share of tokens clipped below 1 - clip_low.")
    smooth: int = Field(3, ge=1, description=SMOOTH)
    max_frac: float = Field(
        0.3, gt=0, le=1, description="Clipped share that fires: 0.1-0.2 is healthy PPO; above 0.3 steps are too big.")


ALL_STEPS = ("Steps in a row in which it held for all of them that fire at once, before the smooth window fills: "
             "such a run learns nothing, and says so within its first steps; one step alone can be chance.")


class ZeroVarianceSettings(Section):
    metric: str = Field("adv/zero_std_group_frac", description=METRIC)
    smooth: int = Field(5, ge=1, description=SMOOTH + " Several steps: a few flat batches are normal.")
    max_frac: float = Field(0.5, ge=0, le=1, description="Share of groups with no gradient that fires: half.")
    all_steps: int = Field(2, ge=1, description="Every group flat (equal rewards). " + ALL_STEPS)
    reward_metric: str = Field("reward/mean", description="Train reward key, named in that message (a reward "
                                                          "that never varies shows its one value).")


class TruncationSettings(Section):
    metric: str = Field("completion/truncation_rate", description=METRIC)
    baseline: int = Field(1, ge=1, description=BASELINE)
    smooth: int = Field(3, ge=1, description=SMOOTH)
    max_rate: float = Field(0.2, ge=0, le=1, description="Truncated share that fires: one completion in five.")
    max_rise: float = Field(0.1, ge=0, description="Rise over the start that fires: ten points more truncation.")
    all_steps: int = Field(2, ge=1, description="Every completion cut at the length limit. " + ALL_STEPS)


class ToolErrorsSettings(Section):
    metric: str = Field("agent/tool_error_rate", description=METRIC + " Logged by runs with agent.tools.")
    program_metric: str = Field("agent/program_error_rate", description=(
        "The share of an agent program's episodes that failed (raised, timed out, never called the model); logged "
        "by runs with agent.program or a verifiers environment, and held to the same min_rate."))
    metrics: list[str] = Field(
        default_factory=lambda: [f"agent/errors/{kind}" for kind in ("malformed", "unknown_tool", "bad_arguments",
                                                                     "raised", "timeout", "bad_result",
                                                                     "too_many_calls", "program_raised",
                                                                     "program_timeout", "program_no_call")],
        description="Failed calls (and failed program episodes) per kind (rollout/agent/tools.py EPISODE_ERRORS), "
                    "named in the message with the fix for the most frequent one.")
    smooth: int = Field(2, ge=1, description=SMOOTH + " Two: said within the first steps, not on one unlucky batch.")
    min_rate: float = Field(
        1.0, gt=0, le=1, description="Failed share that fires (at or above it): every call, so the model never "
                                     "reads a tool's result. A policy still learning the call syntax fails many.")


class InfraErrorsSettings(Section):
    metric: str = Field("reward/infra_error_rate", description=METRIC)
    smooth: int = Field(1, ge=1, description=SMOOTH)
    max_rate: float = Field(
        0.05, ge=0, le=1, description="Unverifiable share that fires, well before scoring.max_infra_error_rate stops.")


class RewardDisagreementSettings(Section):
    metric: str = Field("reward/disagreement", description="The ensemble's disagreement (std across reward models) "
                        "in the total reward's units; logged when a reward_model_ensemble is among the rewards.")
    reward_metric: str = Field("reward/mean", description="Train reward key.")
    window: int = Field(10, ge=1, description="Records between the two ends compared: long enough that a trend "
                                              "is not one odd batch.")
    smooth: int = Field(3, ge=1, description="Records averaged at each end of the window.")
    max_growth: float = Field(
        0.5, gt=0, description="Relative growth of the disagreement that fires (with a rising reward): +50% is "
                               "beyond batch noise for the std of a few models.")
    min_reward_rise: float = Field(
        0.0, ge=0, description="Rise of the train reward that counts: any (reward models have no common scale).")


class EarlyStopSettings(Section):
    """Ending a run early, as a completed run with `final/` exported: when the held-out `metric` has not
    improved by more than `min_delta` for `patience` evaluations, or when the logged KL exceeds `kl_stop`.
    Both are off until set. See guides/monitoring.md#stopping-early-and-keeping-the-best."""

    metric: str | None = Field(
        None, description="Held-out metric for plateau stopping, e.g. eval/accuracy (None: off).")
    mode: Literal["max", "min"] = Field("max", description="The metric is better larger (max) or smaller (min).")
    patience: int = Field(3, ge=1, description="Evals without improvement before stopping.")
    min_delta: float = Field(0.0, ge=0, description="An improvement must exceed this to reset the patience.")
    kl_stop: float | None = Field(None, gt=0, description="Stop when the logged KL exceeds this (None: off).")
    kl_metric: str = Field("kl", description="KL key for kl_stop.")


class MonitorConfig(Section):
    """Health detectors and early stopping. Each enabled detector reads the metrics of every logged step and,
    when they cross its thresholds (its own sub-section, `monitor.<detector>`), warns or stops the run with a
    checkpoint, as `on_alert` says. See guides/monitoring.md#health-detectors."""

    enabled: list[DetectorName] = Field(default_factory=lambda: list(DETECTOR_NAMES),
                                        description="Detectors to run on every logged step.")
    on_alert: dict[DetectorName, Literal["warn", "stop"]] = Field(
        default_factory=dict, description="Action per detector: 'warn' (default) or 'stop' (checkpoint and exit).")
    reward_hacking: RewardHackingSettings = Field(default_factory=RewardHackingSettings)
    length_drift: LengthDriftSettings = Field(default_factory=LengthDriftSettings)
    repetition: RepetitionSettings = Field(default_factory=RepetitionSettings)
    kl: KlSettings = Field(default_factory=KlSettings)
    entropy_collapse: EntropyCollapseSettings = Field(default_factory=EntropyCollapseSettings)
    ratio_drift: RatioDriftSettings = Field(default_factory=RatioDriftSettings)
    clip_fraction: ClipFractionSettings = Field(default_factory=ClipFractionSettings)
    zero_variance: ZeroVarianceSettings = Field(default_factory=ZeroVarianceSettings)
    truncation: TruncationSettings = Field(default_factory=TruncationSettings)
    tool_errors: ToolErrorsSettings = Field(default_factory=ToolErrorsSettings)
    infra_errors: InfraErrorsSettings = Field(default_factory=InfraErrorsSettings)
    reward_disagreement: RewardDisagreementSettings = Field(default_factory=RewardDisagreementSettings)
    repetition_ngram: int = Field(3, ge=1, description="n of the n-grams in completion/repetition_rate.")
    repetition_unit: Literal["word", "char"] = Field(
        "word", description="Units of those n-grams: words, or characters for text without spaces.")
    early_stop: EarlyStopSettings = Field(default_factory=EarlyStopSettings)

    def thresholds(self, name: str) -> dict[str, Any]:
        """Keyword arguments of detector `name`."""
        return getattr(self, name).model_dump()

    def action(self, name: str) -> str:
        return self.on_alert.get(name, "warn")  # type: ignore[call-overload]

    def watched_keys(self) -> set[str]:
        """metrics.jsonl keys any enabled detector or the early stop reads (what the monitor keeps)."""
        keys = {"step", self.early_stop.kl_metric}
        if self.early_stop.metric:
            keys.add(self.early_stop.metric)
        for name in self.enabled:
            for field, value in self.thresholds(name).items():
                if field == "metric" or field.endswith("_metric"):
                    keys.add(value)
                elif field == "metrics":
                    keys.update(value)
        return keys


class LoggerSettings(Section):
    """The logging backends and their options (fields of the `logging:` section, and what
    `rlft.monitor.loggers.build_loggers` takes). metrics.jsonl is always written: resume and reports read it."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl"], description="Where metrics go besides metrics.jsonl (always written).")
    wandb_project: str = Field("rlft", description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); default: your W&B default.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="'offline' writes under the run dir and never needs the network "
                               "(`wandb sync RUN/wandb/offline-run-*` uploads later); 'online' needs `wandb login`.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default: a local SQLite store under the run dir (RUN/mlflow/).")
    mlflow_experiment: str = Field("rlft", description="MLflow experiment name.")



class LoggingConfig(LoggerSettings):
    """What a run records as it goes: how often metrics are written and sample completions saved (online
    methods), the console progress bar, and backends beside metrics.jsonl, which is always written
    (TensorBoard, W&B, MLflow; each needs its extra). See guides/monitoring.md#logging-backends."""

    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")
    sample_every: int = Field(10, ge=1, description="Save sample completions every N steps (online).")
    num_samples: int = Field(4, ge=0, description="Completions saved per sampling step.")
    progress: bool = Field(True, description="Show a console progress bar.")
