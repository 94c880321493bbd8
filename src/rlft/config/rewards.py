"""What scores a completion: the `rewards` list and `scoring`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlft import paths
from rlft.config.section import Section, _local, check_device


class RewardSpec(Section):
    """One reward component: a function that scores each completion (a built-in name, or your own
    `module:function` / `file.py:function`), the arguments of a built-in, and its weight in the summed
    reward; its name labels the component's metrics (`reward/<name>`). Online methods need at least one; an
    SFT run scores its held-out generations with them, and each eval suite lists its own. See guides/rewards.md."""

    fn: str = Field(description="Built-in name (math, exact_match, regex, json_fields, ...) or 'module:function' / 'file.py:function'.")
    name: str | None = Field(None, description="Component name in logs (default: derived from fn).")
    weight: float = Field(1.0, description="Weight in the weighted sum of components.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a built-in reward's factory.")

    @field_validator("fn")
    @classmethod
    def _file_ref(cls, value: str) -> str:
        target, sep, _ = value.rpartition(":")
        if sep and target.endswith(".py"):
            _local(target, f"reward {value!r}")
        return paths.function_ref(value)

    @field_validator("args")
    @classmethod
    def _reward_model_args(cls, args: dict[str, Any], info: Any) -> dict[str, Any]:
        fn = info.data.get("fn")
        if fn not in ("reward_model", "reward_model_ensemble"):
            return args
        if isinstance(args.get("device"), str):
            check_device(args["device"], f"{fn} args.device")
        if fn == "reward_model" and isinstance(args.get("path"), str):  # weights: a folder or a hub id
            return {**args, "path": paths.existing(_local(args["path"], "reward_model args.path"))}
        members = args.get("paths")
        if fn == "reward_model_ensemble" and isinstance(members, list) and all(isinstance(p, str) for p in members):
            return {**args, "paths": [paths.existing(_local(p, f"reward_model_ensemble args.paths[{i}]"))
                                      for i, p in enumerate(members)]}
        return args

    @property
    def component(self) -> str:
        """The component's name in logs: `name`, else the function's name."""
        return self.name or self.fn.rpartition(":")[2]


class ScoringConfig(Section):
    """The rules every reward call of a run follows, in training steps and evaluations alike: how many run at
    once, the time limit of one call, the largest value accepted, and what stops the run: a reward that raises
    or returns garbage, one that times out again and again, or too large a share of unverifiable rewards in a
    step. See guides/rewards.md#the-rules-reward-code-runs-under."""

    max_workers: int = Field(8, ge=1, description="Reward calls run concurrently (threads; sandboxes are processes).")
    max_infra_error_rate: float = Field(
        0.5, ge=0, le=1, description="Stop when a step's share of unverifiable (None) rewards exceeds this.")
    timeout_s: float = Field(
        60.0, gt=0, description="Time limit of one reward call, from its start (a batch reward gets this per "
                                "sample); a call past it is unverifiable (None), counted as reward/timeouts and "
                                "warned about. 60 s is far above a rule reward's milliseconds and covers the code "
                                "reward's own bound (its program timeout, 10 s by default, + 5 s sandbox start-up, "
                                "twice when calls wait for a free sandbox); a shorter limit than a code reward "
                                "needs is refused at start-up.")
    max_consecutive_timeouts: int | None = Field(
        8, ge=1, description="Stop the run (with a checkpoint of the last completed step) when one reward's calls "
                             "time out this many times in a row: counted in the order the calls end, across steps, "
                             "and reset by any call of that reward that ends in time. null: never stop for this.")
    max_abs_reward: float | None = Field(
        1e4, gt=0, description="Largest |value| a reward call may return (each component and each part of a dict "
                               "reward). Verifiable rewards live in a small fixed range (0..1, -1..1); a value "
                               "like 1e9 is a bug in the reward (a raw count, a missing scale), and under Dr. GRPO "
                               "(no std division) it would make every update sign-only. A value beyond it is a "
                               "reward error, handled as on_reward_error says. null: no bound (non-finite values "
                               "are refused regardless).")
    on_reward_error: Literal["stop", "unverifiable"] = Field(
        "stop", description="A reward call that raises or returns something other than a float, None or a dict of "
                            "floats (NaN, inf, a string, a list): stop the run with one message naming the reward "
                            "and the row, or count the row as unverifiable (None; reward/errors, a warning).")
