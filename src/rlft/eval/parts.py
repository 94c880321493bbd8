"""What sampling and scoring a model needs outside a training run, built in one place: its engine,
the turn driver when answers are agent episodes (the prompts checked with the tools' descriptions),
and the scorer. `rlft eval`, `rlft compare`, the data commands and the demos all build it here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlft.config import AgentConfig, Config, VllmSettings
from rlft.models.loading import LoadedModel, load_policy
from rlft.rewards.scoring import RewardScorer, build_scorer
from rlft.rollout import Engine, build_engine
from rlft.rollout.agent import agent_driver, check_prompts_with_tools, reward_specs
from rlft.rollout.agent.turns import TurnDriver


@dataclass
class EvalParts:
    policy: LoadedModel
    engine: Engine
    driver: TurnDriver | None  # agent episodes instead of single answers
    scorer: RewardScorer | None
    agent: AgentConfig | None = None
    max_prompt_length: int = 4096

    @classmethod
    def build(cls, policy: LoadedModel, *, seed: int, engine: str = "hf", batch_size: int | None = None,
              vllm: VllmSettings | None = None, fast_decode: bool = True, agent: AgentConfig | None = None,
              prompt_sets: Sequence[Sequence[Any]] = (), max_prompt_length: int = 4096,
              scorer: RewardScorer | None = None) -> "EvalParts":
        """An engine on `policy` and, with `agent`, its turn driver with every set of prompts checked."""
        sampler = build_engine(policy, seed, engine, batch_size, fast_decode, vllm)
        try:
            driver = agent_driver(agent, sampler, policy.tokenizer, prompt_sets, max_prompt_length, seed)
        except BaseException:
            sampler.close()
            raise
        return cls(policy, sampler, driver, scorer, agent, max_prompt_length)

    @classmethod
    def from_config(cls, config: Config, policy: LoadedModel | None = None,
                    prompt_sets: Sequence[Sequence[Any]] = ()) -> "EvalParts":
        """A config's own parts: its rewards (checked before the model loads), its model, the engine
        and sampling `rollout` sets, its `agent`."""
        rewards = reward_specs(config.rewards, config.agent)
        scorer = build_scorer(rewards, config.scoring) if rewards else None
        policy = policy or load_policy(config.model, config.lora)
        r = config.rollout
        return cls.build(policy, seed=config.seed, engine=r.engine, batch_size=r.batch_size, vllm=r.vllm,
                         fast_decode=r.fast_decode, agent=config.agent, prompt_sets=prompt_sets,
                         max_prompt_length=config.data.max_prompt_length, scorer=scorer)

    def check_prompts(self, examples: Sequence[Any]) -> None:
        """Prompts read after the parts were built, checked as episodes will see them."""
        if self.driver is not None:
            check_prompts_with_tools(self.driver, examples, self.max_prompt_length, self.agent.max_total_tokens)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "EvalParts":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
