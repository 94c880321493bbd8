"""User-facing errors.

Anything a user can fix (a config typo, a bad data row, a template mismatch) is raised as an
`RlftError` subclass with a message that names the place and the fix. The CLI prints these
without a traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class RlftError(Exception):
    """An error the user can fix; the message says where and how."""


class ConfigError(RlftError):
    """The config file or an override is invalid."""


class DataError(RlftError):
    """A dataset is unreadable or has invalid rows."""


class TemplateMismatchError(RlftError):
    """The chat template differs from the one a checkpoint was trained with."""


class ResumeError(RlftError):
    """A run cannot be resumed as asked."""


class TrainingHalted(RlftError):
    """Training stopped on purpose (non-finite guard, infra errors, zero steps left)."""


class RewardError(RlftError):
    """A reward function failed at run time: it raised, returned something that is not a reward,
    or timed out too often. The message names the reward, the row and the fix."""


class EnvironmentFailed(RlftError):
    """An agent environment failed at run time: its constructor, reset or step raised or returned
    something the protocol does not allow. The message names the environment, the row and the fix."""


class RankStopped(RlftError):
    """Another rank of a distributed run stopped this step on an error (named in the message);
    this rank stops at the same step, so their collectives stay paired."""


class ServerError(RlftError):
    """A rollout server (`rollout.servers`) is unreachable, refused the key, serves another model,
    or failed mid-run with no other server left; the message names the server and the fix."""
