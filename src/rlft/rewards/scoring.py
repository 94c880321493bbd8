"""The reward contract, the registry of built-ins, user functions from config, and weighted
composition with a logged value per component.

A reward function is `fn(prompt, completion, **row) -> float | None | dict[str, float | None]`:
- `prompt` is the last message of the conversation (the question); `row` holds the dataset row's
  other fields (e.g. `answer`, `tests`; a reference answer stored as `completion` arrives as
  `reference_completion`) plus what the trainer knows about the sample: `messages` (the whole
  conversation answered, system prompt and earlier turns included), `rendered_prompt` (that
  conversation through the chat template, exactly as the model saw it), `finish_reason`
  ('stop' | 'length'), `completion_tokens`, `max_new_tokens`.
  Functions take `**kwargs` and ignore what they don't use.
- `None` means "could not be verified" (a sandbox that failed to start, a malformed test): the
  sample is left out of its group's baseline and gets advantage 0, and it is counted.
- A dict is a set of named parts (e.g. code: parse / run / tests); its parts are logged as
  `<name>/<part>` and their sum is the component's value.

Two optional attributes on a reward function change how it is called or combined:
- `fn.batch(prompts, completions, rows) -> list[RewardValue]`: scored in one call (a reward
  model batches its forward passes) instead of one call per sample on a thread pool;
- `fn.is_guard = True`: a guard (e.g. a safety filter) returns 0.0 when the sample is fine and
  the floor value when it fires; a firing guard replaces the whole total (unsafe output gets
  the minimum reward, whatever else it earned: no correctness credit can buy it back).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from rlft.config import RewardSpec
from rlft.errors import ConfigError

RewardValue = float | None | dict[str, float | None]


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, **row: Any) -> RewardValue: ...


# name -> factory(**args) -> RewardFn. Built-ins register themselves on import of rlft.rewards.
BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in BUILTIN_REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        BUILTIN_REWARDS[name] = factory
        return factory

    return wrap


def load_user_function(ref: str, what: str = "reward") -> Callable[..., Any]:
    """Import `package.module:function` or `path/to/file.py:function`."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{what} {ref!r}: write it as 'module:function' or 'path/file.py:function'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{what} {ref!r}: file not found: {path}")
        name = f"rlft_user_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ConfigError(f"{what} {ref!r}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"{what} {ref!r}: cannot import module {target!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {ref!r}: {target} has no function {attr!r}")
    return fn


def build_reward(spec: RewardSpec) -> tuple[str, RewardFn]:
    """Resolve a config entry to (component name, function)."""
    from rlft import rewards as _builtins  # noqa: F401  (registers the built-ins)

    if ":" in spec.fn:
        fn = load_user_function(spec.fn)
        needs = _fields_without_default(fn, spec.args)
        if spec.args or needs:  # our own wrapper: the user's function object is never annotated
            fn = _bind(fn, spec.args)
            fn.required_fields = needs
        return spec.name or spec.fn.rpartition(":")[2], fn
    factory = BUILTIN_REWARDS.get(spec.fn)
    if factory is None:
        import difflib

        guess = difflib.get_close_matches(spec.fn, list(BUILTIN_REWARDS), n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(f"rewards: unknown reward {spec.fn!r}.{hint} Built-ins: {', '.join(sorted(BUILTIN_REWARDS))}; "
                          "or use 'module:function' / 'file.py:function'")
    try:
        inspect.signature(factory).bind(**spec.args)
    except TypeError as exc:
        raise ConfigError(f"rewards: {spec.fn}: bad args {spec.args}: {exc}") from None
    return spec.name or spec.fn, factory(**spec.args)


def scoring_row(fields: dict[str, Any], finish_reason: str, completion_tokens: int, max_new_tokens: int,
                messages: list[dict[str, Any]] | None = None, rendered_prompt: str | None = None) -> dict[str, Any]:
    """The keyword arguments a reward gets for one sample: the prompt row's fields plus what the
    generation adds (SCORING_FIELDS): the whole conversation that was answered (`messages`: system
    prompt and earlier turns included) and the prompt text exactly as the model saw it
    (`rendered_prompt`: chat template applied)."""
    row = dict(fields, finish_reason=finish_reason, completion_tokens=completion_tokens,
               max_new_tokens=max_new_tokens)
    if messages is not None:
        row["messages"] = messages
    if rendered_prompt is not None:
        row["rendered_prompt"] = rendered_prompt
    return row


def score_completions(scorer: "RewardScorer", examples: list[Any], completions: list[Any],
                      max_new_tokens: int) -> "Scores":
    """Score completion i as the answer to examples[i] (a PromptExample: its last message, fields,
    conversation and rendered prompt; a Completion: text, finish reason, token count)."""
    rows = [scoring_row(e.fields, c.finish_reason, len(c.completion_ids), max_new_tokens, e.messages, e.rendered)
            for e, c in zip(examples, completions)]
    return scorer.score([e.prompt_text for e in examples], [c.text for c in completions], rows)


# added to every row by scoring_row, so never required from the data
SCORING_FIELDS = ("finish_reason", "completion_tokens", "max_new_tokens", "messages", "rendered_prompt")


def _fields_without_default(fn: Callable[..., Any], bound: dict[str, Any]) -> tuple[str, ...]:
    """Row fields a user function cannot be called without: its named parameters after
    (prompt, completion) that have no default and are not given in the reward's args."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to learn
        return ()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(p.name for p in named[2:]
                 if p.default is p.empty and p.name not in bound and p.name not in SCORING_FIELDS)


def _bind(fn: Callable[..., Any], args: dict[str, Any]) -> RewardFn:
    def bound(prompt: str, completion: str, **row: Any) -> RewardValue:
        return fn(prompt, completion, **{**row, **args})

    return bound


@dataclass
class Scores:
    """Rewards for N samples. `total[i]` is None when sample i could not be verified."""

    total: list[float | None]
    components: dict[str, list[float | None]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        valid = [r for r in self.total if r is not None]
        n = len(self.total)
        out["reward/mean"] = _mean(valid)
        out["reward/std"] = _std(valid)
        out["reward/unverifiable_frac"] = (n - len(valid)) / n if n else 0.0
        for name, values in self.components.items():
            out[f"reward/{name}"] = _mean([v for v in values if v is not None])
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


class RewardScorer:
    """Weighted composition of reward components, scored concurrently with a bounded pool."""

    def __init__(self, specs: list[RewardSpec], max_workers: int = 8):
        built = [build_reward(s) for s in specs]
        names = [n for n, _ in built]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ConfigError(f"rewards: component names must be unique; give 'name:' to {sorted(dupes)}")
        self.components = [(name, fn, spec.weight) for (name, fn), spec in zip(built, specs)]
        self.max_workers = max_workers
        # every prompt row must carry these (checked with the data, before training starts)
        self.required_fields = tuple(dict.fromkeys(
            f for _, fn, _ in self.components for f in getattr(fn, "required_fields", ())))

    def score(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> Scores:
        n = len(completions)
        components: dict[str, list[float | None]] = {}
        totals: list[float | None] = [0.0] * n
        guards: list[float | None] = [None] * n
        for name, fn, weight in self.components:
            values = self._run(fn, prompts, completions, rows)
            if getattr(fn, "is_guard", False):
                for i, v in enumerate(values):
                    if v:  # fired (non-zero); None means the guard itself could not decide
                        guards[i] = float(v)
            parts = [_split(name, v) for v in values]
            comp_values = [p[0] for p in parts]
            components[name] = comp_values
            for key in sorted({k for _, sub in parts for k in sub}):
                components[key] = [sub.get(key) for _, sub in parts]
            if getattr(fn, "is_guard", False):
                continue
            for i, value in enumerate(comp_values):
                if totals[i] is None or weight == 0:
                    continue
                totals[i] = None if value is None else totals[i] + weight * value
        totals = [g if g is not None else t for g, t in zip(guards, totals)]
        return Scores(totals, components)

    def _run(self, fn: RewardFn, prompts, completions, rows) -> list[RewardValue]:
        def one(i: int) -> RewardValue:
            return fn(prompts[i], completions[i], **_row_kwargs(rows[i]))

        batch = getattr(fn, "batch", None)
        if batch is not None:
            return list(batch(prompts, completions, rows))
        if self.max_workers <= 1 or len(completions) <= 1:
            return [one(i) for i in range(len(completions))]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(completions))) as pool:
            return list(pool.map(one, range(len(completions))))


def _row_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The row as keyword arguments; `prompt` / `completion` are the positional ones."""
    if "prompt" in row or "completion" in row:
        return {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    return row


def _split(name: str, value: RewardValue) -> tuple[float | None, dict[str, float | None]]:
    if isinstance(value, dict):
        parts = {f"{name}/{k}": (None if v is None else float(v)) for k, v in value.items()}
        total = None if any(v is None for v in parts.values()) else sum(parts.values())
        return total, parts
    if value is None:
        return None, {}
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} returned a non-finite value {value}; return None for 'unverifiable'")
    return value, {}
