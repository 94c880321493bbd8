"""Pure tensor maths for RL fine-tuning: no model, no I/O.

Each family is a registry of functions behind one signature, so a trainer picks a variant by
name from the config and never branches on it.
"""

from rlft.algorithms.advantages import (ADVANTAGE_ESTIMATORS, EPISODE_LEVEL, per_episode, reverse_kl_advantages,
                                        sequence_scores, whiten, zero_variance_groups)
from rlft.algorithms.aggregation import AGGREGATIONS, aggregate
from rlft.algorithms.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, KLController,
                                ProportionalKLController, make_kl_controller)
from rlft.algorithms.policy_loss import POLICY_LOSSES
from rlft.algorithms.preference_losses import PREFERENCE_LOSSES, bradley_terry
from rlft.algorithms.value import clipped_value_loss, discounted_returns, gae

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "EPISODE_LEVEL",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "ProportionalKLController",
    "aggregate",
    "bradley_terry",
    "clipped_value_loss",
    "discounted_returns",
    "gae",
    "make_kl_controller",
    "per_episode",
    "reverse_kl_advantages",
    "sequence_scores",
    "whiten",
    "zero_variance_groups",
]
