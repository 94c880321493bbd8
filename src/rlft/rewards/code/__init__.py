"""Code reward: run generated programs against tests in a sandbox (see sandbox.py for the layers).

Importing this package registers the `code` reward.
"""

from rlft.rewards.code.cases import BadTests, CaseResult, Credit, Verdict, parse_tests
from rlft.rewards.code.reward import extract_code, judge_completion
from rlft.rewards.code.sandbox import Limits, isolation_layers, run_program

__all__ = ["BadTests", "CaseResult", "Credit", "Limits", "Verdict", "extract_code", "isolation_layers",
           "judge_completion", "parse_tests", "run_program"]
