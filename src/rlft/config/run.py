"""The whole run's config: every section together, the presets resolved, and the checks that
span sections."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from rlft import paths
from rlft.config.algorithm import (_BASE_PRESET, CLIP_WARN, METHOD_LEARNING_RATES, ONLINE_LR_RANGE, ONLINE_METHODS,
                                   PRESETS, AlgorithmConfig, CriticConfig, DpoConfig, Method, RewardModelConfig)
from rlft.config.data import DataConfig
from rlft.config.eval import EvalConfig
from rlft.config.model import LoraConfig, ModelConfig, TeacherConfig
from rlft.config.monitor import LoggingConfig, MonitorConfig
from rlft.config.rewards import RewardSpec, ScoringConfig
from rlft.config.rollout import AgentConfig, RolloutConfig, check_vllm_sampling
from rlft.config.section import Section, _local
from rlft.config.training import CheckpointConfig, TrainingConfig


class Config(Section):
    method: Method = Field("sft", description="Training method; online presets choose algorithm parts.")
    output_dir: str = Field(description="Run directory (created; resumable).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rewards: list[RewardSpec] = Field(default_factory=list, description=(
        "Reward components (online methods). Left out with a verifiers environment (agent.environment: "
        "verifiers:...): its rubric, one program component per rubric function with the rubric's weight."))
    agent: AgentConfig | None = Field(
        None, description="Multi-turn rollouts with tools and/or an environment (None: single-turn).")
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    teacher: TeacherConfig | None = Field(None, description="method: distill only: the model whose per-token "
                                                            "log-probs the student learns from.")
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    adopt_output_dir: bool = Field(
        False, description="Use an output_dir that holds other files and is not an rlft run directory "
                           "(its config.yaml, metrics.jsonl, summary.json and final/ would be overwritten).")

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, value: str) -> str:
        value = paths.absolute(_local(value, "output_dir"))
        problem = paths.name_length_problem(value, "output_dir")
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, values: Any) -> Any:
        """Resolve what depends on the method: the online preset's algorithm parts and the
        learning rate, so config.yaml states every value the run used."""
        if not isinstance(values, dict):
            return values
        method = values.get("method", "sft")
        algo = values.get("algorithm") or {}
        if method in PRESETS and isinstance(algo, dict):
            resolved = {**_BASE_PRESET, **PRESETS[method]}
            resolved.update({k: v for k, v in algo.items() if v is not None})
            values = {**values, "algorithm": resolved}
        training = values.get("training") or {}
        if method in METHOD_LEARNING_RATES and isinstance(training, dict) and training.get("learning_rate") is None:
            values = {**values, "training": {**training, "learning_rate": METHOD_LEARNING_RATES[method]}}
        return values

    @model_validator(mode="after")
    def _check_consistency(self) -> "Config":
        if self.model.quantization == "4bit":
            if not self.lora.enabled:
                raise ValueError("model.quantization=4bit: 4-bit weights cannot be trained directly; set "
                                 "lora.enabled: true")
            if self.method == "reward_model":
                raise ValueError("model.quantization=4bit is for causal-LM policies; reward-model training is not "
                                 "quantised; set model.quantization=none")
            if self.is_online and self.rollout.engine == "vllm":
                raise ValueError("model.quantization=4bit with rollout.engine=vllm: the trainer's 4-bit weights "
                                 "cannot be synced into vLLM; use rollout.engine=hf")
        if self.training.compile and self.model.gradient_checkpointing:
            # the recompute in backward runs the eager layer, which saves other tensors than the
            # compiled forward did: torch.utils.checkpoint stops with a metadata mismatch
            raise ValueError("training.compile with model.gradient_checkpointing: the compiled layers cannot be "
                             "recomputed in backward; set one of them to false (gradient checkpointing saves "
                             "memory, compile saves time)")
        if self.algorithm.sft_mix and not self.is_online:
            raise ValueError(f"algorithm.sft_mix adds an SFT loss to online RL; method {self.method} does not use it")
        if self.agent is not None:
            if not self.is_online and self.method != "sft":
                raise ValueError(f"agent: tools are used in online rollouts and in SFT on tool-use transcripts; "
                                 f"method {self.method} does neither (drop the agent section, or use sft or an "
                                 "online method such as grpo)")
        verifiers = self.agent is not None and (self.agent.environment or "").startswith("verifiers:")
        named = [s for s in (self.data.train, self.data.eval) if isinstance(s, str) and s.startswith("verifiers:")]
        if named and not verifiers:
            raise ValueError(f"data source {named[0]!r} reads the dataset of agent.environment 'verifiers:...', and "
                             "agent.environment names none; set it (e.g. agent.environment: verifiers:my_env)")
        env_rewards = [r.component for r in self.rewards if r.fn == "environment"]
        if env_rewards and (self.agent is None or self.agent.environment is None):
            raise ValueError(f"rewards: {env_rewards[0]!r} (fn: environment) scores by an environment's rewards, "
                             "and agent.environment is not set; set it, or drop that reward")
        if self.eval.suites and self.method == "reward_model":
            raise ValueError("eval.suites evaluate a policy's generations; a reward model does not generate "
                             "(its held-out metrics come from data.eval)")
        self._check_distillation()
        if self.is_online:
            if self.rollout.group_size < 2 and self.method != "distill":  # distillation needs no group baseline
                raise ValueError(
                    f"rollout.group_size is {self.rollout.group_size}; group-relative methods need at least 2 "
                    "completions per prompt (8 or 16 is typical)")
            if not self.rewards and not verifiers:  # a verifiers environment's rewards are its rubric's
                raise ValueError("rewards: an online method needs at least one reward component, e.g. "
                                 "rewards: [{fn: math}]")
            a = self.algorithm
            if a.dual_clip is not None and a.dual_clip <= 1:
                raise ValueError(f"algorithm.dual_clip must be > 1 (got {a.dual_clip}); null turns it off")
            if a.dual_clip is not None and a.policy_loss != "clipped":
                raise ValueError(f"algorithm.dual_clip bounds the token-level clipped surrogate; policy_loss "
                                 f"{a.policy_loss} has no such term (drop dual_clip)")
            if a.clip_low is not None and a.clip_low >= 1 and a.policy_loss != "cispo":
                raise ValueError(f"algorithm.clip_low={a.clip_low:g}: the ratio's lower bound is 1 - clip_low, which "
                                 "must lie in (0, 1), so clip_low must be in (0, 1) (PPO uses 0.2; only "
                                 "policy_loss=cispo may set 1, no lower bound on its weight)")
            if a.kl_target is not None and not a.kl_coef:
                raise ValueError(
                    f"algorithm.kl_target={a.kl_target} adapts beta multiplicatively, but beta starts at "
                    f"algorithm.kl_coef={a.kl_coef} (the {self.method} preset) and would stay 0. Set a starting "
                    "value, e.g. algorithm.kl_coef=0.01, or drop kl_target")
            if a.kl_controller == "proportional" and a.kl_target is None:
                raise ValueError(
                    "algorithm.kl_controller=proportional steers beta toward algorithm.kl_target, which is not set "
                    "(beta stays fixed at kl_coef without one). Set a target KL per token, e.g. "
                    "algorithm.kl_target=0.05, or drop kl_controller")
            if self.rollout.engine == "vllm":  # evaluations during training sample on the same engine
                check_vllm_sampling(self.eval.temperature, 1.0, 0, "eval")
                for suite in self.eval.suites:
                    check_vllm_sampling(suite.sampling.temperature, 1.0, 0, f"eval.suites[{suite.name}].sampling")
            _check_async(self)
            if a.loss_agg == "constant" and a.loss_constant is None:  # Dr. GRPO: the longest possible completion
                longest = self.agent.max_total_tokens if self.agent else self.rollout.max_new_tokens
                self.algorithm.loss_constant = longest
        return self

    def _check_distillation(self) -> None:
        if self.method == "distill":
            if self.teacher is None:
                raise ValueError("method: distill learns from a teacher's log-probs; set teacher.path to the "
                                 "teacher model (same tokenizer as model.path)")
            if self.algorithm.advantage != "reverse_kl":
                raise ValueError(f"method: distill takes its advantages from the teacher (advantage: reverse_kl); "
                                 f"algorithm.advantage={self.algorithm.advantage} would ignore it")
        elif self.teacher is not None:
            raise ValueError(f"teacher: is used by method distill only; method {self.method} would ignore it "
                             "(drop the teacher section, or set method: distill)")
        elif self.is_online and self.algorithm.advantage == "reverse_kl":
            raise ValueError("algorithm.advantage=reverse_kl needs a teacher: use method: distill with teacher.path")

    @property
    def is_online(self) -> bool:
        return self.method in ONLINE_METHODS

    @property
    def needs_reference(self) -> bool:
        """A reference model is built only when a KL term will use it."""
        if self.method == "dpo":
            return True
        return self.is_online and bool(self.algorithm.kl_coef)


def _check_async(config: Config) -> None:
    """What rollout.async_steps > 0 cannot be combined with, each with its reason."""
    k, a, r = config.rollout.async_steps, config.algorithm, config.rollout
    if r.sampler_device != "auto" and not k:
        raise ValueError(f"rollout.sampler_device={r.sampler_device}: a synchronous run (rollout.async_steps=0) "
                         "samples from the trainer's own module, on model.device; set rollout.async_steps=1 or "
                         "drop rollout.sampler_device")
    if r.sampler_device != "auto" and r.engine == "vllm":
        raise ValueError(f"rollout.sampler_device={r.sampler_device} places the hf engine's copy of the policy; "
                         "the vLLM engine places itself (its GPUs are those its process sees): drop "
                         "rollout.sampler_device")
    if not k:
        return
    if a.rollout_correction not in ("tis", "bypass"):
        raise ValueError(f"rollout.async_steps={k}: batches are sampled by weights up to {k} optimizer steps old, so "
                         "the loss must correct for it: set algorithm.rollout_correction to tis (truncated importance "
                         "weights) or bypass (the sampler's log-probs as pi_old)")
    if a.dynamic_sampling:
        raise ValueError(f"rollout.async_steps={k} with algorithm.dynamic_sampling (the {config.method} preset "
                         "turns it on): refilling dropped groups is not paced by policy version yet; set "
                         "algorithm.dynamic_sampling=false or rollout.async_steps=0")
    if config.model.quantization != "none":
        raise ValueError(f"rollout.async_steps={k} with model.quantization={config.model.quantization}: the sampler "
                         "samples from its own copy of the policy, which 4-bit weights cannot be copied into; set "
                         "rollout.async_steps=0")


def config_warnings(config: Config) -> list[str]:
    """Settings that are valid but unusual enough to say so when a run starts."""
    out = []
    lr = config.training.learning_rate
    low, high = ONLINE_LR_RANGE
    if config.is_online and not low / 10 <= lr <= high * 10:
        out.append(f"training.learning_rate={lr:g} is far outside the {low:g}..{high:g} typical for online RL on "
                   "pretrained models (fine for a tiny model trained from scratch)")
    if config.is_online:
        for name in ("clip_low", "clip_high"):
            value = getattr(config.algorithm, name)
            # cispo clips a weight, not the update: its wide range is the point
            if value is not None and value > CLIP_WARN and config.algorithm.policy_loss != "cispo":
                out.append(f"algorithm.{name}={value:g} is above {CLIP_WARN}: one update can move token "
                           "probabilities far from the sampling policy (PPO uses 0.2, DAPO's clip-higher 0.28)")
        a = config.algorithm
        # a changed setting of a controller the run does not use (the preset fills both in)
        for name, controller in (("kl_horizon", "proportional"), ("kl_adapt_factor", "deadband")):
            value = getattr(a, name)
            if value == _BASE_PRESET[name] or (a.kl_target is not None and a.kl_controller == controller):
                continue
            why = ("beta is fixed without algorithm.kl_target" if a.kl_target is None else
                   f"algorithm.kl_controller is {a.kl_controller}")
            out.append(f"algorithm.{name}={value:g} has no effect: only adaptive KL with kl_controller={controller} "
                       f"uses it, and {why}")
    return out
