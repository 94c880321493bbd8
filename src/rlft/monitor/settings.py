"""Settings of the health monitor (the `monitor:` config section) and of the logging backends.

Each detector has its own sub-section whose fields are exactly the keyword arguments of its
function in `rlft.monitor.detectors`, so the defaults live here once. Fields named `metric`,
`*_metric` or `metrics` name the metrics.jsonl keys a detector reads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlft.config import Section

DetectorName = Literal["reward_hacking", "length_drift", "repetition", "kl", "entropy_collapse", "ratio_drift",
                       "clip_fraction", "zero_variance", "truncation", "infra_errors"]
DETECTOR_NAMES: tuple[str, ...] = DetectorName.__args__  # type: ignore[attr-defined]  (== DETECTORS' keys)


class RewardHackingSettings(Section):
    reward_metric: str = "reward/mean"
    eval_metric: str = "eval/accuracy"
    eval_mode: Literal["max", "min"] = "max"  # eval_metric is better when larger (accuracy) or smaller (loss)
    window: int = Field(3, ge=2)  # evals: fewer cannot tell a trend from held-out noise
    min_reward_rise: float = 0.1  # a tenth of a 0-1 reward is a real gain, beyond step-to-step noise
    max_eval_gain: float = 0.01  # held-out "flat": at most one point of accuracy gained over the window


class LengthDriftSettings(Section):
    metric: str = "completion/length_mean"
    baseline: int = Field(1, ge=1)  # records averaged for the start: the SFT policy's length at step 0/1
    smooth: int = Field(3, ge=1)  # per-batch lengths are noisy; judge a 3-step mean
    max_drift: float = Field(0.15, gt=0)  # > 15% away from the starting length is a hacking warning sign
    growth_window: int = Field(5, ge=1)  # steps over which "fast growth" is measured
    max_growth: float = Field(0.1, gt=0)  # +10% in 5 steps would pass the 15% budget within a few more


class RepetitionSettings(Section):
    metric: str = "completion/repetition_rate"
    baseline: int = Field(1, ge=1)
    smooth: int = Field(3, ge=1)
    max_rate: float = Field(0.3, ge=0)  # natural answers repeat almost no word 3-gram; 30% is a loop
    max_rise: float = Field(0.1, ge=0)  # ten points more repetition than the SFT policy had


class KlSettings(Section):
    metric: str = "kl"
    smooth: int = Field(3, ge=1)
    max_kl: float = Field(0.5, gt=0)  # nats/token; GRPO at beta=0.04 usually stays below 0.1
    growth_window: int = Field(5, ge=1)
    max_growth: float = Field(3.0, gt=1)  # tripling between consecutive 5-step windows is a blow-up, not drift
    min_kl: float = Field(0.05, ge=0)  # below this, growth from ~0 early in training is normal


class EntropyCollapseSettings(Section):
    metric: str = "entropy"
    baseline: int = Field(1, ge=1)
    smooth: int = Field(3, ge=1)
    min_entropy: float = Field(0.05, ge=0)  # nats/token: near-greedy sampling, groups stop differing
    max_drop: float = Field(0.75, gt=0, le=1)  # three quarters of the starting entropy gone


class RatioDriftSettings(Section):
    metrics: list[str] = Field(default_factory=lambda: ["ratio/mean", "rollout/ratio_mean"])
    max_metric: str = "ratio/max"
    smooth: int = Field(1, ge=1)  # a single off-policy step is already worth a look
    max_mean: float = Field(1.3, gt=1)  # mean ratio above ~1.3 means training is off-policy
    max_max: float = Field(10.0, gt=1)  # a token 10x likelier under the trained weights than when sampled


class ClipFractionSettings(Section):
    high_metric: str = "clip/high_frac"
    low_metric: str = "clip/low_frac"
    smooth: int = Field(3, ge=1)
    max_frac: float = Field(0.3, gt=0, le=1)  # PPO practice: 0.1-0.2 is healthy; above 0.3 steps are too big


class ZeroVarianceSettings(Section):
    metric: str = "adv/zero_std_group_frac"
    smooth: int = Field(5, ge=1)  # "for several steps": a few flat batches are normal
    max_frac: float = Field(0.5, ge=0, le=1)  # half the groups give no gradient


class TruncationSettings(Section):
    metric: str = "completion/truncation_rate"
    baseline: int = Field(1, ge=1)
    smooth: int = Field(3, ge=1)
    max_rate: float = Field(0.2, ge=0, le=1)  # one completion in five cut at max_new_tokens
    max_rise: float = Field(0.1, ge=0)  # ten points more truncation than at the start


class InfraErrorsSettings(Section):
    metric: str = "reward/infra_error_rate"
    smooth: int = Field(1, ge=1)
    max_rate: float = Field(0.05, ge=0, le=1)  # well before scoring.max_infra_error_rate stops the run


class EarlyStopSettings(Section):
    metric: str | None = None  # held-out metric for plateau stopping, e.g. eval/accuracy (None: off)
    mode: Literal["max", "min"] = "max"
    patience: int = Field(3, ge=1)  # evals without improvement before stopping
    min_delta: float = Field(0.0, ge=0)  # an improvement must exceed this to reset the patience
    kl_stop: float | None = Field(None, gt=0)  # stop when the logged KL exceeds this (None: off)
    kl_metric: str = "kl"


class MonitorConfig(Section):
    """Health detectors, early stopping and the choice of final model."""

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
    infra_errors: InfraErrorsSettings = Field(default_factory=InfraErrorsSettings)
    repetition_ngram: int = Field(3, ge=1, description="n of the n-grams in completion/repetition_rate.")
    repetition_unit: Literal["word", "char"] = Field(
        "word", description="Units of those n-grams: words, or characters for text without spaces.")
    early_stop: EarlyStopSettings = Field(default_factory=EarlyStopSettings)
    final: Literal["last", "best"] = Field(
        "last", description="Export the last weights, or the best checkpoint by best_metric, as final/.")
    best_metric: str | None = Field(
        None, description="Metric choosing the best checkpoint (default: early_stop.metric).")

    @model_validator(mode="after")
    def _best_needs_metric(self) -> "MonitorConfig":
        if self.final == "best" and self.chosen_best_metric is None:
            raise ValueError("monitor.final is 'best' but no metric says which is best: set monitor.best_metric "
                             "(e.g. eval/accuracy) or monitor.early_stop.metric")
        return self

    @property
    def chosen_best_metric(self) -> str | None:
        return self.best_metric or self.early_stop.metric

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
    """Extra logging backends (to become fields of the `logging:` section). metrics.jsonl is always
    written: resume and reports read it."""

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
