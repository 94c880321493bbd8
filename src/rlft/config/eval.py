"""Held-out evaluation: `eval` and its suites."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from rlft import paths
from rlft.config.rewards import RewardSpec
from rlft.config.section import Section, _local


class SuiteSampling(Section):
    """How one eval suite samples its answers: completions per prompt (the k of pass@k and maj@k),
    temperature, answer length and generation batch. Each suite has its own; the `eval` section's sampling
    fields do not apply to suites. See guides/evaluation.md#evaluation-suites."""

    num_samples: int = Field(1, ge=1, description="Completions per prompt (k of pass@k and maj@k).")
    temperature: float = Field(0.0, ge=0, description="0: greedy; > 0: sampled.")
    max_new_tokens: int = Field(128, ge=1, description="Longest completion.")
    batch_size: int = Field(64, ge=1, description="Sequences generated per forward.")


class EvalSuite(Section):
    """One named held-out set with its own prompts, rewards, sampling and cadence, logged under
    `eval/<name>/` (accuracy, pass@k, maj@k, format compliance, lengths, the gap to the train reward). Suites
    run during training for every method but reward_model, and `rlft eval RUN` without `--data` evaluates a
    run's suites. See guides/evaluation.md#evaluation-suites."""

    name: str = Field(description="Metric prefix: eval/<name>/...; letters, digits, '_', '-' and '.'.")
    data: str = Field(description="Prompt rows (.jsonl/.json/.parquet, a saved dataset or 'hf:NAME').")
    split: str = Field("train", description="Split of an 'hf:NAME' dataset.")
    rewards: list[RewardSpec] = Field(default_factory=list, description="Reward components (default: none).")
    correct_component: str | None = Field(
        None, description="Reward component that means 'correct' (default: the first).")
    correct_threshold: float = Field(1.0, description="A sample is correct when that component is >= this.")
    sampling: SuiteSampling = Field(default_factory=SuiteSampling)
    format_regex: str | None = Field(None, description="A completion is compliant when it stops and fully matches.")
    max_examples: int | None = Field(256, ge=1, description="Rows used (None: all).")
    every: int | None = Field(
        None, ge=1, description="Run every N steps (default: training.eval_every); always after the last step.")
    answer: str | None = Field(
        "math", description="maj@k answer extractor: 'math' (boxed / 'answer is' / last number), "
                            "'module:function' (completion -> answer or None), or null (no maj@k).")

    @field_validator("data")
    @classmethod
    def _data_location(cls, value: str) -> str:
        return paths.data_location(_local(value, "eval.suites[].data"))

    @field_validator("answer")
    @classmethod
    def _file_ref(cls, value: str | None) -> str | None:
        return None if value is None else paths.function_ref(value)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise ValueError(f"eval suite name {value!r} must use letters, digits, '_', '-' or '.' only")
        return value

    def eval_config(self) -> EvalConfig:
        s = self.sampling
        return EvalConfig(max_examples=self.max_examples, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                          num_samples=s.num_samples, format_regex=self.format_regex,
                          correct_component=self.correct_component, correct_threshold=self.correct_threshold,
                          batch_size=s.batch_size)

    def due(self, step: int, total_steps: int, default_every: int | None = None) -> bool:
        every = self.every or default_every
        return step == total_steps or bool(every) and step % every == 0


class EvalConfig(Section):
    """Held-out evaluation by generation: how many `data.eval` prompts are answered and how (temperature,
    samples per prompt, length, batch), and which reward component counts as correct. It applies to online
    runs and SFT runs with rewards, every `training.eval_every` steps and after the last, and to `rlft eval`
    of a run; `suites` adds named held-out sets with settings of their own. See guides/evaluation.md."""

    max_examples: int | None = Field(256, ge=1, description="Held-out rows used for generation metrics (None: all).")
    max_new_tokens: int = Field(128, ge=1, description="Longest completion when evaluating.")
    temperature: float = Field(0.0, ge=0, description="0: greedy; > 0: sampled.")
    num_samples: int = Field(1, ge=1, description="Completions per prompt (k for pass@k).")
    format_regex: str | None = Field(
        None, description="A completion is format-compliant when it stops cleanly and fully matches this regex.")
    correct_component: str | None = Field(
        None, description="Reward component that means 'correct' for accuracy (default: the first).")
    correct_threshold: float = Field(1.0, description="A sample is correct when that component is >= this.")
    batch_size: int = Field(64, ge=1, description="Sequences generated per forward when evaluating.")
    suites: list[EvalSuite] = Field(
        default_factory=list, description="Named held-out sets (target, retention, adversarial...), each with its "
                                          "own data, rewards and sampling; metrics eval/<name>/...")
