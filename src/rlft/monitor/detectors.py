"""Health detectors: small pure functions over the metrics history.

Each detector reads the per-step records that `metrics.jsonl` holds (oldest first; a plain list, or
the incremental `History` the Monitor keeps) and its thresholds as keyword arguments, and returns an `Alert` (with the numbers that triggered it) or
None. They keep no state: firing once per episode and the configured action are the `Monitor`'s
job. A record without a detector's metric (an eval-only line, an offline method) is skipped, so a
detector only ever looks at the steps that logged its metric.

"Current" values are the mean over the last `smooth` records that have the metric (per-batch
metrics are noisy; one odd batch should not raise an alert), "start" values the mean over the
first `baseline` records (the SFT policy at step 0/1). Windows count logged records, which are
steps when `logging.log_every` is 1.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Record = dict[str, Any]
Points = list[tuple[int, float]]  # (step, value), oldest first


@dataclass(frozen=True)
class Alert:
    detector: str
    step: int
    message: str
    values: dict[str, float] = field(default_factory=dict)  # metric names -> the values that fired
    action: Literal["warn", "stop"] = "warn"

    def to_event(self) -> dict[str, Any]:
        """The line written to events.jsonl."""
        return {"step": self.step, "detector": self.detector, "action": self.action, "message": self.message,
                "values": self.values}


DETECTORS: dict[str, Callable[..., Alert | None]] = {}


def detector(name: str) -> Callable[[Callable[..., Alert | None]], Callable[..., Alert | None]]:
    def register(fn: Callable[..., Alert | None]) -> Callable[..., Alert | None]:
        DETECTORS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------------------------
# Reading the history


class History:
    """Records appended one at a time, each key's (step, value) series kept as it grows, so that a
    detector reads a series in O(1) however long the run (rescanning a list of records every step
    made monitoring quadratic: ~0.17 s per step after 4,000 steps)."""

    def __init__(self, records: list[Record] = ()):
        self._series: dict[str, Points] = {}
        self.last_step = 0
        for record in records:
            self.append(record)

    def append(self, record: Record) -> None:
        step = int(record.get("step", self.last_step))
        self.last_step = step
        for key, value in record.items():
            if key != "step" and _is_number(value):
                self._series.setdefault(key, []).append((step, float(value)))

    def series(self, key: str) -> Points:
        return self._series.get(key, [])

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "series": {k: [list(p) for p in v] for k, v in self._series.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "History":
        history = cls()
        history.last_step = state["last_step"]
        history._series = {k: [(int(s), float(v)) for s, v in points] for k, points in state["series"].items()}
        return history


AnyHistory = list[Record] | History  # detectors accept either; tests pass plain lists


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(history: AnyHistory, key: str) -> Points:
    """(step, value) of every record holding a finite number under `key`. Do not modify the result."""
    if isinstance(history, History):
        return history.series(key)
    return [(int(r.get("step", i)), float(r[key])) for i, r in enumerate(history) if _is_number(r.get(key))]


def _between(points: Points, lo: float, hi: float) -> Points:
    """Points with lo < step <= hi (steps never decrease)."""
    return points[bisect_right(points, (lo, math.inf)):bisect_right(points, (hi, math.inf))]


def _mean(points: Points) -> float:
    return sum(v for _, v in points) / len(points)


def _current(points: Points, smooth: int) -> float | None:
    """Mean of the last `smooth` values; None until there are that many."""
    return _mean(points[-smooth:]) if len(points) >= smooth else None


def _start(points: Points, baseline: int, smooth: int) -> float | None:
    """Mean of the first `baseline` values; None until the last `smooth` come after them. On a short
    run the two windows overlap and a change from the start is measured partly against itself (a
    random model's lengths at step 3 read as drift)."""
    return _mean(points[:baseline]) if len(points) >= baseline + smooth else None


def _last_step(history: AnyHistory) -> int:
    if isinstance(history, History):
        return history.last_step
    return int(history[-1].get("step", len(history) - 1)) if history else 0


def _g(x: float) -> str:
    return f"{x:.4g}"


def _level_alert(name: str, history: AnyHistory, metric: str, smooth: int, limit: float,
                 what: str) -> Alert | None:
    """Fires when the current (smoothed) value of `metric` is above `limit`."""
    now = _current(series(history, metric), smooth)
    if now is None or not now > limit:
        return None
    return Alert(name, _last_step(history),
                 f"{metric} {_g(now)}{_over(smooth)} is above {_g(limit)}: {what}", {metric: now, "limit": limit})


def _since(start: float | None) -> str:
    return "" if start is None else f"start {_g(start)}; "


def _over(smooth: int) -> str:
    return f" (mean of the last {smooth} steps)" if smooth > 1 else ""


def _every(points: Points, steps: int) -> bool:
    """Whether the last `steps` values are all 1: a share that held for every group, completion or
    call of each of those steps (a case a run learns nothing from, said at once, before any window
    of means fills)."""
    return len(points) >= steps and all(v >= 1.0 for _, v in points[-steps:])


def _in_each(steps: int) -> str:
    return "in the last step" if steps == 1 else f"in each of the last {steps} steps"


# ---------------------------------------------------------------------------------------------
# The detectors


@detector("reward_hacking")
def reward_hacking(history: AnyHistory, *, reward_metric: str, eval_metric: str, eval_mode: Literal["max", "min"],
                   window: int, min_reward_rise: float, max_eval_gain: float) -> Alert | None:
    """Train reward rising while the held-out metric is flat or falling over the last `window` evals.

    The train reward at an eval is the mean over the records since the previous eval (up to and
    including this one), so one lucky batch does not count as a rise.
    """
    evals = series(history, eval_metric)
    if len(evals) < max(window, 2):
        return None
    rewards = series(history, reward_metric)
    (s0, e0), (s1, e1) = evals[-window], evals[-1]
    before = evals[-window - 1][0] if len(evals) > window else -math.inf
    reward_first, reward_last = _between(rewards, before, s0), _between(rewards, evals[-2][0], s1)
    if not reward_first or not reward_last:
        return None
    r0, r1 = _mean(reward_first), _mean(reward_last)
    gain = (e1 - e0) if eval_mode == "max" else (e0 - e1)  # held-out improvement, in the metric's units
    if not (r1 - r0 > min_reward_rise and gain <= max_eval_gain):
        return None
    return Alert("reward_hacking", _last_step(history),
                 f"train {reward_metric} rose {_g(r0)} -> {_g(r1)} (+{_g(r1 - r0)}) between steps {s0} and {s1} "
                 f"while held-out {eval_metric} went {_g(e0)} -> {_g(e1)} over the last {window} evals: the "
                 "policy may be exploiting the reward (check samples for length/format tricks)",
                 {reward_metric: r1, eval_metric: e1, "reward_rise": r1 - r0, "eval_gain": gain})


@detector("length_drift")
def length_drift(history: AnyHistory, *, metric: str, baseline: int, smooth: int, max_drift: float,
                 growth_window: int, max_growth: float) -> Alert | None:
    """Mean completion length more than `max_drift` (relative) away from its start, or grown by
    more than `max_growth` (relative) over the last `growth_window` records."""
    points = series(history, metric)
    start, now = _start(points, baseline, smooth), _current(points, smooth)
    if start is None or now is None or start <= 0:
        return None
    drift = now / start - 1
    if abs(drift) > max_drift:
        way = "longer" if drift > 0 else "shorter"
        return Alert("length_drift", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} is {abs(drift):.0%} {way} than at the start ({_g(start)}); "
                     f"limit {max_drift:.0%}: answers drifting in length are a reward-hacking sign",
                     {metric: now, "start": start, "drift": drift})
    if len(points) >= growth_window + smooth:
        earlier = _mean(points[-growth_window - smooth:-growth_window])
        growth = now / earlier - 1 if earlier > 0 else 0.0
        if growth > max_growth:
            return Alert("length_drift", _last_step(history),
                         f"{metric} grew {growth:.0%} in {growth_window} steps ({_g(earlier)} -> {_g(now)}); "
                         f"limit {max_growth:.0%}", {metric: now, "earlier": earlier, "growth": growth})
    return None


@detector("repetition")
def repetition(history: AnyHistory, *, metric: str, baseline: int, smooth: int, max_rate: float,
               max_rise: float) -> Alert | None:
    """The batch's n-gram repetition rate above `max_rate`, or risen by more than `max_rise` over its start."""
    points = series(history, metric)
    start, now = _start(points, baseline, smooth), _current(points, smooth)
    if now is None:
        return None
    if now > max_rate or (start is not None and now - start > max_rise):
        return Alert("repetition", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} ({_since(start)}limits: {_g(max_rate)}, or a rise of "
                     f"{_g(max_rise)}): completions repeat themselves; look at the samples",
                     {metric: now, "start": start})
    return None


@detector("kl")
def kl(history: AnyHistory, *, metric: str, smooth: int, max_kl: float, growth_window: int, max_growth: float,
       min_kl: float) -> Alert | None:
    """KL to the reference above `max_kl`, or its mean over the last `growth_window` records more
    than `max_growth` times the mean over the window before (once it is above `min_kl`)."""
    points = series(history, metric)
    now = _current(points, smooth)
    if now is not None and now > max_kl:
        return Alert("kl", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} is above {_g(max_kl)}: the policy is moving far from the "
                     "reference (raise the KL coefficient or lower the learning rate)", {metric: now, "limit": max_kl})
    if len(points) >= 2 * growth_window:
        recent = _mean(points[-growth_window:])
        before = _mean(points[-2 * growth_window:-growth_window])
        if recent > min_kl and recent > max_growth * max(before, 0.0):
            return Alert("kl", _last_step(history),
                         f"{metric} grew from {_g(before)} to {_g(recent)} (means of consecutive {growth_window}-step "
                         f"windows; limit x{_g(max_growth)}): KL is blowing up", {metric: recent, "earlier": before})
    return None


@detector("entropy_collapse")
def entropy_collapse(history: AnyHistory, *, metric: str, baseline: int, smooth: int, min_entropy: float,
                     max_drop: float) -> Alert | None:
    """Token entropy below `min_entropy`, or fallen by more than the fraction `max_drop` from its start."""
    points = series(history, metric)
    start, now = _start(points, baseline, smooth), _current(points, smooth)
    if now is None:
        return None
    drop = 1 - now / start if start is not None and start > 0 else 0.0
    if now < min_entropy:  # a level: said as one, whichever way it moved since the start
        return Alert("entropy_collapse", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} is below the floor {_g(min_entropy)}"
                     f"{'' if start is None else f' (start {_g(start)})'}: sampling is near-greedy, the policy "
                     "stops exploring", {metric: now, "start": start, "drop": drop})
    if drop > max_drop:
        return Alert("entropy_collapse", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} has fallen {drop:.0%} from {_g(start)} (limit: a "
                     f"{max_drop:.0%} drop): the policy stops exploring", {metric: now, "start": start, "drop": drop})
    return None


@detector("ratio_drift")
def ratio_drift(history: AnyHistory, *, metrics: list[str], max_metric: str, smooth: int, max_mean: float,
                max_max: float) -> Alert | None:
    """Mean importance ratio (the first of `metrics` that is logged) above `max_mean`, or the
    largest token ratio above `max_max`: the sampler's policy is not the one being trained."""
    for metric in metrics:
        now = _current(series(history, metric), smooth)
        if now is not None and now > max_mean:
            return Alert("ratio_drift", _last_step(history),
                         f"{metric} {_g(now)}{_over(smooth)} is above {_g(max_mean)}: training is off-policy (rollout "
                         "weights lag the trained weights, or engine and trainer log-probs disagree)",
                         {metric: now, "limit": max_mean})
    top = _current(series(history, max_metric), 1)
    if top is not None and top > max_max:
        return Alert("ratio_drift", _last_step(history),
                     f"{max_metric} {_g(top)} is above {_g(max_max)}: some tokens are far more likely under the "
                     "trained policy than under the sampler", {max_metric: top, "limit": max_max})
    return None


@detector("clip_fraction")
def clip_fraction(history: AnyHistory, *, high_metric: str, low_metric: str, smooth: int,
                  max_frac: float) -> Alert | None:
    """Share of tokens whose ratio was clipped (high + low) above `max_frac`: updates are too large."""
    high, low = series(history, high_metric)[-smooth:], series(history, low_metric)[-2 * smooth:]
    by_step = dict(low)  # the low fraction of the same steps (a step without one counts 0)
    points = [(s, v + by_step.get(s, 0.0)) for s, v in high]
    now = _current(points, smooth)
    if now is None or not now > max_frac:
        return None
    return Alert("clip_fraction", _last_step(history),
                 f"{high_metric} + {low_metric} = {_g(now)}{_over(smooth)} is above {_g(max_frac)}: policy updates "
                 "are too large (lower the learning rate or the update epochs)",
                 {high_metric: high[-1][1], low_metric: by_step.get(high[-1][0], 0.0), "clip_frac": now})


@detector("zero_variance")
def zero_variance(history: AnyHistory, *, metric: str, smooth: int, max_frac: float, all_steps: int,
                  reward_metric: str) -> Alert | None:
    """Many groups whose completions all scored alike (no advantage, no learning signal); every
    group of each of the last `all_steps` steps fires at once: nothing is learned at all."""
    if _every(series(history, metric), all_steps):
        rewards = series(history, reward_metric)
        mean = f" ({reward_metric} {_g(rewards[-1][1])})" if rewards else ""
        return Alert("zero_variance", _last_step(history),
                     f"every group's completions got equal rewards {_in_each(all_steps)} ({metric} 1){mean}: no "
                     "advantage, so the run learns nothing. Check that the reward can tell completions apart (one "
                     "that returns the same value for every completion, or fails on all of them), or use prompts "
                     "the policy solves sometimes, not always or never", {metric: 1.0, "steps": float(all_steps)})
    return _level_alert("zero_variance", history, metric, smooth, max_frac,
                        "many prompt groups give no learning signal (all completions scored alike): the data is "
                        "too easy or too hard for the policy, or the reward is too coarse")


@detector("truncation")
def truncation(history: AnyHistory, *, metric: str, baseline: int, smooth: int, max_rate: float,
               max_rise: float, all_steps: int) -> Alert | None:
    """Share of completions cut at max_new_tokens above `max_rate`, or risen by more than `max_rise`;
    every completion of each of the last `all_steps` steps cut fires at once."""
    points = series(history, metric)
    if _every(points, all_steps):
        return Alert("truncation", _last_step(history),
                     f"every completion hit the length limit {_in_each(all_steps)} ({metric} 1): none ends on its "
                     "own, so the rewards score cut-off answers and the run learns little or nothing. Raise "
                     "rollout.max_new_tokens (agent.max_total_tokens for episodes), or teach the format to stop "
                     "first (SFT)", {metric: 1.0, "steps": float(all_steps)})
    start, now = _start(points, baseline, smooth), _current(points, smooth)
    if now is None:
        return None
    if now > max_rate or (start is not None and now - start > max_rise):
        return Alert("truncation", _last_step(history),
                     f"{metric} {_g(now)}{_over(smooth)} ({_since(start)}limits: {_g(max_rate)}, or a rise of "
                     f"{_g(max_rise)}): completions are not finishing (raise rollout.max_new_tokens, or penalise "
                     "length)", {metric: now, "start": start})
    return None


# the fix for the kind of failed tool call seen most (agent/errors/<kind>: rollout/agent/tools.py ERROR_KINDS)
_TOOL_FIXES = {
    "raised": "the tool raises: call it by hand with the arguments in samples.jsonl's transcripts",
    "timeout": "the tool does not return within agent.tool_timeout_s: make it faster or raise the limit",
    "bad_result": "the tool returns something that is not text (None, an object): return a str",
    "malformed": "the model's calls cannot be read: check that agent.parser is the model's call syntax, or SFT on "
                 "tool-use transcripts first",
    "unknown_tool": "the model calls tools that are not in agent.tools: check their names",
    "bad_arguments": "the model's arguments do not fit the tools' signatures: check their docstrings and type hints",
    "too_many_calls": "the model makes more calls per turn than agent.max_calls_per_turn",
    "program_raised": "the agent program raises: the log has each traceback (a warning per episode); run it by hand "
                      "on a row of the data",
    "program_timeout": "the agent program runs past agent.episode_timeout_s: raise the limit, or bound its loop",
    "program_no_call": "the agent program returns without calling the model: it must send its requests with the "
                       "client it is given (its base_url and key are the run's endpoint)",
}


_PROGRAM = ("program_raised", "program_timeout", "program_no_call")  # rollout/agent/tools.py PROGRAM_ERRORS


@detector("tool_errors")
def tool_errors(history: AnyHistory, *, metric: str, program_metric: str, metrics: list[str], smooth: int,
                min_rate: float) -> Alert | None:
    """An agent's failed tool calls at or above the share `min_rate` (by default every call) over the
    last `smooth` records: the model never reads a tool's result; or, with an agent program, its
    failed episodes (`program_metric`: raised, timed out, never called the model) at that share:
    nothing is trained. The message names the kinds (`metrics`, counts per step) and the fix for the
    most frequent one."""
    program = _current(series(history, program_metric), smooth) if program_metric else None
    if program is not None and program >= min_rate:
        metric, now, kinds = program_metric, program, [k for k in metrics if k.rsplit("/", 1)[-1] in _PROGRAM]
    else:
        now, kinds = _current(series(history, metric), smooth), [k for k in metrics
                                                                  if k.rsplit("/", 1)[-1] not in _PROGRAM]
        if now is None or now < min_rate:
            return None
    counted = {key.rsplit("/", 1)[-1]: sum(v for _, v in series(history, key)[-smooth:]) for key in kinds}
    seen = sorted(((n, kind) for kind, n in counted.items() if n > 0), reverse=True)
    counts = f" ({', '.join(f'{kind}: {n:g}' for n, kind in seen)})" if seen else ""
    fix = f": {_TOOL_FIXES[seen[0][1]]}" if seen and seen[0][1] in _TOOL_FIXES else ""
    if metric == program_metric:
        what = (f"every agent program episode failed {_in_each(smooth)}{counts}" if now >= 1.0 else
                f"{metric} {_g(now)}{_over(smooth)}{counts}: most agent program episodes fail")
        what += ", so nothing is trained (a failed episode has reward 0 and no tokens)"
    elif now >= 1.0:
        what = (f"every tool call failed {_in_each(smooth)}{counts}: the model never gets a tool's result, so the "
                "run learns nothing about using its tools")
    else:
        what = (f"{metric} {_g(now)}{_over(smooth)}{counts}: the model rarely gets a tool's result, so the run "
                "learns nothing about using its tools")
    return Alert("tool_errors", _last_step(history), f"{what}{fix}",
                 {metric: now, **{f"errors/{kind}": n for n, kind in seen}})


@detector("infra_errors")
def infra_errors(history: AnyHistory, *, metric: str, smooth: int, max_rate: float) -> Alert | None:
    """Share of rewards that could not be computed (None) above `max_rate`."""
    return _level_alert("infra_errors", history, metric, smooth, max_rate,
                        "rewards could not be computed (sandbox, reward service or data problem), which biases "
                        "the advantages")


@detector("reward_disagreement")
def reward_disagreement(history: AnyHistory, *, metric: str, reward_metric: str, window: int, smooth: int,
                        max_growth: float, min_reward_rise: float) -> Alert | None:
    """A reward-model ensemble's disagreement grown by more than `max_growth` (relative) over the
    last `window` records while the train reward rose by more than `min_reward_rise`: the policy
    is moving where the reward models stop agreeing, off the data they know, which is where a
    proxy reward gets exploited (Coste et al., arXiv:2310.02743). Both ends are `smooth`-record means."""
    points, rewards = series(history, metric), series(history, reward_metric)
    if len(points) < window + smooth or len(rewards) < window + smooth:
        return None
    d0, d1 = _mean(points[-window - smooth:-window]), _mean(points[-smooth:])
    r0, r1 = _mean(rewards[-window - smooth:-window]), _mean(rewards[-smooth:])
    growth = d1 / d0 - 1 if d0 > 0 else (math.inf if d1 > 0 else 0.0)
    if not (growth > max_growth and r1 - r0 > min_reward_rise):
        return None
    return Alert("reward_disagreement", _last_step(history),
                 f"{metric} grew {_g(d0)} -> {_g(d1)} (+{growth:.0%}; limit {max_growth:.0%}) over {window} steps while "
                 f"{reward_metric} rose {_g(r0)} -> {_g(r1)}: the reward models disagree more where the policy now "
                 "goes, a reward-hacking sign (look at the samples; combine: pessimistic penalises disagreement)",
                 {metric: d1, "start": d0, "growth": growth, reward_metric: r1, "reward_rise": r1 - r0})
