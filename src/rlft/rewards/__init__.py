"""Reward functions. Importing this package registers the built-ins (see `scoring.BUILTIN_REWARDS`)."""

from rlft.rewards import (  # noqa: F401  (the rest)
                                  code,
                                  ensemble,
                                  gym,
                                  llm_judge,
                                  math,
                                  reward_model,
                                  rules,  # noqa: F401  (registers exact_match, regex, json_fields)
                                  shaping,
)
from rlft.rewards.scoring import BUILTIN_REWARDS, RewardFn, RewardScorer, Scored, Scores, build_scorer, register_reward

__all__ = ["BUILTIN_REWARDS", "RewardFn", "RewardScorer", "Scored", "Scores", "build_scorer", "register_reward"]
