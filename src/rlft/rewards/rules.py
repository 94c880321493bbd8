"""Rule rewards: exact match, regex / format, JSON with required fields, an environment's own rewards.

Each built-in is a factory (its config `args` are the factory's arguments) returning a function
with the reward contract of `rlft.rewards.scoring`.
"""

from __future__ import annotations

import json
import numbers
import re
from typing import Any

from rlft.rewards.scores import Scored
from rlft.rewards.scoring import RewardFn, register_reward


@register_reward("exact_match")
def exact_match(field: str = "answer", strip: bool = True, case_sensitive: bool = True) -> RewardFn:
    """1.0 when the completion equals row[field], else 0.0.

    >>> exact_match()("q", " 42 ", answer="42")
    1.0
    """

    def norm(s: str) -> str:
        s = s.strip() if strip else s
        return s if case_sensitive else s.lower()

    def reward(prompt: str, completion: str, **row: Any) -> float:
        return float(norm(completion) == norm(str(row[field])))

    reward.required_fields = (field,)
    return reward


@register_reward("regex")
def regex(pattern: str, mode: str = "search", flags: str = "") -> RewardFn:
    """1.0 when the completion matches `pattern` (mode: search | fullmatch), else 0.0.

    A format check: use it next to a content check, never alone (a reward that only checks form
    is satisfied by well-formed wrong answers).

    >>> regex(r"The answer is \\d+\\.", mode="fullmatch")("q", "The answer is 7.")
    1.0
    """
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"regex mode must be 'search' or 'fullmatch', got {mode!r}")
    compiled = re.compile(pattern, _flags(flags))
    match = compiled.fullmatch if mode == "fullmatch" else compiled.search

    def reward(prompt: str, completion: str, **row: Any) -> float:
        return float(match(completion.strip()) is not None)

    return reward


def _flags(letters: str) -> int:
    table = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}
    out = 0
    for ch in letters:
        if ch not in table:
            raise ValueError(f"regex flags: unknown flag {ch!r} (use i, m, s)")
        out |= table[ch]
    return out


_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)


def extract_json(text: str) -> Any | None:
    """The JSON value in a completion: a ```json fence, else the outermost {...} span."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        candidates.append(text[start:end + 1])
    candidates.append(text.strip())
    for cand in candidates:
        try:
            return json.loads(cand)
        except (json.JSONDecodeError, ValueError):
            continue
    return None


@register_reward("json_fields")
def json_fields(required: list[str] | None = None, field: str | None = None, check_values: bool = False) -> RewardFn:
    """Graded JSON reward: 0 if no JSON object parses; else the fraction of required fields present
    (and, with check_values, equal to row[field][name]).

    `required` comes from the args, or per row from row[field] (a dict of expected values).

    >>> json_fields(required=["name", "age"])("q", '{"name": "x"}')
    0.5
    """

    def reward(prompt: str, completion: str, **row: Any) -> float:
        obj = extract_json(completion)
        if not isinstance(obj, dict):
            return 0.0
        expected: dict[str, Any] = {}
        if field is not None:
            expected = dict(row.get(field) or {})
        names = list(required or expected)
        if not names:
            return 1.0
        hits = 0
        for name in names:
            if name in obj and (not check_values or name not in expected or obj[name] == expected[name]):
                hits += 1
        return hits / len(names)

    reward.required_fields = (field,) if field is not None and not required else ()
    return reward


_REDUCERS = {"sum": sum, "last": lambda xs: xs[-1], "mean": lambda xs: sum(xs) / len(xs), "max": max}


@register_reward("environment")
def environment(reduce: str = "sum") -> RewardFn:
    """The rewards the episode's environment gave at its steps (agent.environment), reduced to one
    value: sum (the episode's return), last, mean or max. An episode with no step (every turn a
    tool call, or its first turn cut) earned nothing: 0.0.

    >>> environment()("q", "7", env_rewards=[0.0, 0.0, 1.0])
    1.0
    >>> environment(reduce="mean")("q", "", env_rewards=[])
    0.0
    """
    if reduce not in _REDUCERS:
        raise ValueError(f"environment reduce must be one of {', '.join(_REDUCERS)}, got {reduce!r}")
    combine = _REDUCERS[reduce]

    def reward(prompt: str, completion: str, **row: Any) -> float:
        rewards = row.get("env_rewards")
        if rewards is None:
            raise ValueError("the environment reward needs an episode with an environment (agent.environment)")
        return float(combine(rewards)) if rewards else 0.0

    return reward


@register_reward("program")
def program(key: str | None = None, log_others: bool = False) -> RewardFn:
    """What the episode's agent program returned (agent.program): its float, or with `key` that
    component of the dict it returned (`log_others`: the dict's other numbers are logged beside it
    as `reward/<name>/<entry>`, not added). An episode whose program failed (raised, timed out,
    never called the model) earned 0.0.

    >>> program()("q", "", program_reward=0.5, program_ok=True)
    0.5
    >>> program(key="correct")("q", "", program_reward={"correct": 1.0, "steps": 3}, program_ok=True)
    1.0
    >>> program()("q", "", program_reward=None, program_ok=False)
    0.0
    >>> program(key="reward", log_others=True)("q", "", program_reward={"reward": 0.5, "n/a": 2}, program_ok=True)
    Scored(value=0.5, info={'n_a': 2.0})
    """
    if log_others and key is None:
        raise ValueError("program log_others logs the entries besides args.key; set args.key")

    def reward(prompt: str, completion: str, **row: Any) -> float | Scored:
        if "program_ok" not in row:
            raise ValueError("the program reward needs episodes of an agent program (agent.program)")
        value = row["program_reward"]
        if not row["program_ok"]:
            return 0.0
        if isinstance(value, dict):
            if key is None:
                raise ValueError(f"the agent program returned a dict ({', '.join(value)}): name the component "
                                 "with args: {key: NAME}")
            if key not in value:
                raise ValueError(f"the agent program's result has no {key!r} (it has {', '.join(value)})")
            if log_others:
                return Scored(float(value[key]), {k.replace("/", "_"): float(v) for k, v in value.items()
                                                  if k != key and isinstance(v, numbers.Real)
                                                  and not isinstance(v, bool)})
            value = value[key]
        elif key is not None:
            raise ValueError(f"args.key {key!r}: the agent program returned a number, not a dict")
        return float(value)

    return reward
