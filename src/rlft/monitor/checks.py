"""Checks a training step runs on its own numbers, with the message a user reads when one fails."""

from __future__ import annotations

from pathlib import Path

# A mean importance ratio between the rollout engine and the trainer above this means the samples
# come from a noticeably different policy than the one trained (off-policy training); practitioners
# flag ~1.3 (and correct with truncated importance sampling).
RATIO_DRIFT = 1.3


def engine_drift_warning(metrics: dict[str, float]) -> str | None:
    """Read from the first look at the batch, before any update (`rollout/ratio_mean`), so the
    intended drift of later epochs/minibatches is not mistaken for an engine mismatch."""
    ratio = metrics.get("rollout/ratio_mean")
    if ratio is None or ratio <= RATIO_DRIFT:
        return None
    return (f"the trainer's probability of the sampled tokens is {ratio:.2f}x the rollout engine's on average "
            f"(> {RATIO_DRIFT}): the engine samples from a different policy than the one trained (off-policy). "
            "Check the engine's weight sync and dtype, or set algorithm.rollout_correction=tis")


def infra_error_message(step: int, rate: float, limit: float, checkpoint: Path | None) -> str:
    return (f"stopped at step {step}: {rate:.0%} of rewards could not be computed (None), above "
            f"scoring.max_infra_error_rate={limit}. This is a reward infrastructure or data problem (a sandbox "
            "that cannot start, malformed tests), not a wrong answer."
            + (f" Last state saved to {checkpoint}." if checkpoint else "")
            + "\nFix: check the reward setup with `rlft sandbox run` on one row, or raise the threshold")
