"""Reward functions. Importing this package registers the built-ins (see `scoring.BUILTIN_REWARDS`)."""

from rlft.rewards import rules  # noqa: F401  (registers exact_match, regex, json_fields)
from rlft.rewards import code, ensemble, gym, llm_judge, math, reward_model, shaping  # noqa: F401  (the rest)
from rlft.rewards.scoring import (BUILTIN_REWARDS, RewardFn, RewardScorer, Scored, Scores, build_scorer,
                                  register_reward)

__all__ = ["BUILTIN_REWARDS", "RewardFn", "RewardScorer", "Scored", "Scores", "build_scorer", "register_reward"]
