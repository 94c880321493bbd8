"""Checks a training step runs on its own numbers, with the message a user reads when one fails.
(Trends over many steps are the health detectors' job: monitor/detectors.py.)"""

from __future__ import annotations

from pathlib import Path


def infra_error_message(step: int, rate: float, limit: float, checkpoint: Path | None) -> str:
    return (f"stopped at step {step}: {rate:.0%} of rewards could not be computed (None), above "
            f"scoring.max_infra_error_rate={limit}. This is a reward infrastructure or data problem (a sandbox "
            "that cannot start, a judge endpoint that is down or replies without a score, malformed tests), not a "
            "wrong answer." + (f" Last state saved to {checkpoint}." if checkpoint else "")
            + "\nFix: check the reward setup (`rlft sandbox run` on one row for code; a judge's replies are in "
            "samples.jsonl and the warnings above), or raise the threshold")
