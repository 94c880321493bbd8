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

A reward may also return `Scored(value, info)` (see `rlft.rewards.scores`): the value as above, and
per-sample notes that are logged (numbers as `reward/<name>/<key>` metrics, everything in
samples.jsonl) but never added to the total.

Optional attributes on a reward function change how it is called or combined:
- `fn.batch(prompts, completions, rows) -> list[RewardValue]`: scored in one call (a reward
  model batches its forward passes, an LLM judge runs its own bounded pool of requests) instead
  of one call per sample on a thread pool;
- `fn.is_guard = True`: a guard (e.g. a safety filter) returns 0.0 when the sample is fine and
  the floor value when it fires; a firing guard replaces the whole total (unsafe output gets
  the minimum reward, whatever else it earned: no correctness credit can buy it back);
- `fn.longest_call_s`: the most one sample can take (an LLM judge's attempts and back-off);
  a `scoring.timeout_s` below it is refused at start-up;
- `fn.take_warnings() -> list[str]`: what went wrong since the last report (a judge's failed
  requests), printed with the scorer's own warnings once per step.

Reward code runs under guard (see `calls`): each call has a time limit (`scoring.timeout_s`; a
timed-out call is unverifiable, counted and warned about, and a reward that times out
`scoring.max_consecutive_timeouts` times in a row stops the run); a call that raises or returns
something that is not a reward stops the run with one message naming the reward, the row and the
user's own frames, or (`scoring.on_reward_error: unverifiable`) counts as unverifiable. Each call
gets its own copy of the row, so a reward that edits it in place cannot change what later calls
see; what rewards print is capped per scoring call.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import os
import pickle
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rlft.config import RewardSpec, ScoringConfig
from rlft.errors import ConfigError, RewardError, RlftError
from rlft.rewards.calls import CappedOutput, Outcome, call_all, routed_output
from rlft.rewards.scores import RewardValue, Scored, Scores, check_info, unwrap
from rlft.rewards.user_code import (ALLOWED_VALUES, SCORING_FIELDS, as_reward_value, check_user_function,
                                    describe_exception, indent, load_user_function, wrap_user_function)

log = logging.getLogger(__name__)
__all__ = ["BUILTIN_REWARDS", "SCORING_FIELDS", "RewardFn", "RewardScorer", "Scored", "Scores", "build_reward",
           "build_scorer", "load_user_function", "register_reward", "score_completions", "scoring_row"]


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


# The config entry a built-in reward is being built for (`rewards[0]`), so that one checking a
# folder it is given names the field the user wrote (`rewards[0].args.path`); see `arg_field`.
_BUILDING: ContextVar[str | None] = ContextVar("building_reward", default=None)


def arg_field(name: str) -> str:
    """The config field of a built-in reward's arg `name` (`rewards[0].args.path` while build_reward
    builds `rewards[0]`; `args.path` when the factory is called directly)."""
    where = _BUILDING.get()
    return f"{where}.args.{name}" if where else f"args.{name}"


def build_reward(spec: RewardSpec, where: str | None = None) -> tuple[str, RewardFn]:
    """Resolve a config entry to (component name, function). `where`: the entry in the config
    (`rewards[0]`), for the built-ins' errors (`arg_field`)."""

    if ":" in spec.fn:
        fn = load_user_function(spec.fn)
        return spec.name or spec.fn.rpartition(":")[2], wrap_user_function(fn, spec.args,
                                                                          check_user_function(fn, spec.fn, spec.args))
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
    token = _BUILDING.set(where)
    try:
        fn = factory(**spec.args)
    except (ValueError, TypeError) as exc:  # a built-in refusing an argument's value (e.g. regex mode)
        raise ConfigError(f"rewards: {spec.fn}: {exc}") from None
    finally:
        _BUILDING.reset(token)
    return spec.name or spec.fn, fn


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
            if c.episode is None else episode_row(e, c, max_new_tokens) for e, c in zip(examples, completions)]
    # an environment's first observation took the place of the row's last message: it is the question
    prompts = [e.prompt_text if c.episode is None else c.episode.messages[len(e.messages) - 1]["content"]
               for e, c in zip(examples, completions)]
    return scorer.score(prompts, [c.text for c in completions], rows, [e.where for e in examples])


def episode_row(example: Any, completion: Any, max_new_tokens: int) -> dict[str, Any]:
    """A multi-turn episode's row: `messages` is the whole transcript (the prompt conversation,
    then assistant turns with their `tool_calls` and the `tool` results); the positional
    `completion` is the last assistant turn; `turns`, `tool_calls` and `tool_errors` count.
    `completion_tokens` counts every token after the prompt and `max_new_tokens` is the episode's
    budget they share (so length shaping such as `overlong` measures the whole episode). With an
    environment: `env_rewards` (per step), `env_done` (it ended the episode, no limit did) and
    `env_final` (the last step's observation, when the model never saw it)."""
    ep = completion.episode
    row = scoring_row(example.fields, completion.finish_reason, len(completion.completion_ids),
                      ep.max_tokens or max_new_tokens, ep.messages, example.rendered)
    row.update(turns=ep.turns, tool_calls=ep.tool_calls, tool_errors=sum(ep.errors.values()))
    if ep.env_rewards is not None:
        row.update(env_rewards=list(ep.env_rewards), env_done=ep.env_done, env_final=ep.env_final)
    if ep.program_ok is not None:
        row.update(program_reward=ep.program_reward, program_ok=ep.program_ok)
    return row


# Metric names the scorer writes under reward/: a component of the same name would collide.
RESERVED_NAMES = ("mean", "std", "unverifiable_frac", "infra_error_rate", "timeouts", "errors", "disagreement")


@dataclass
class _Tally:
    """What one reward did since the scorer's last report (one step of training)."""

    calls: int = 0
    timeouts: int = 0
    first_timeout: str = ""
    errors: int = 0
    first_error: str = ""
    output_dropped: int = 0
    cwd_changed_to: str = ""


_Judged = tuple[RewardValue, dict[str, Any]]  # one sample's value and its notes (Scored.info)


class RewardScorer:
    """Weighted composition of reward components, each call run under a time limit on a bounded
    number of threads (see the module docstring for what happens when reward code misbehaves).

    `should_stop()` is polled while calls run (a Ctrl-C: ScoringInterrupted). `warn` receives
    one line per misbehaving reward after each `score()`; with warn=None the lines wait for
    `take_report()` (the online loop prints them once per step, with the step's counts). `where`:
    the config list the specs come from (`rewards`), named in errors as `rewards[i]...`.
    """

    def __init__(self, specs: list[RewardSpec], max_workers: int = 8, *, timeout_s: float = 60.0,
                 max_consecutive_timeouts: int | None = 8, on_error: str = "stop",
                 should_stop: Callable[[], bool] | None = None,
                 warn: Callable[[str], None] | None = log.warning,
                 max_abs_reward: float | None = ScoringConfig.model_fields["max_abs_reward"].default,
                 where: str = "rewards"):
        built = [build_reward(s, f"{where}[{i}]") for i, s in enumerate(specs)]
        names = [n for n, _ in built]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ConfigError(f"rewards: component names must be unique; give 'name:' to {sorted(dupes)}")
        reserved = sorted(set(names) & set(RESERVED_NAMES))
        if reserved:
            raise ConfigError(f"rewards: component name(s) {reserved} would collide with the metrics "
                              f"reward/{reserved[0]}...; give them another 'name:'")
        _check_code_time_limit(specs, timeout_s, max_workers)
        _check_declared_time(built, timeout_s)
        self.components = [(name, fn, spec.weight) for (name, fn), spec in zip(built, specs)]
        self.labels = {name: f"{name!r}" + (f" ({spec.fn})" if spec.fn != name else "")
                       for name, spec in zip(names, specs)}
        self.max_workers, self.timeout_s = max_workers, timeout_s
        self.max_consecutive_timeouts, self.on_error = max_consecutive_timeouts, on_error
        self.should_stop, self.warn, self.max_abs_reward = should_stop, warn, max_abs_reward
        self._tally: dict[str, _Tally] = {}
        self._streak: dict[str, int] = {}  # consecutive timed-out calls per reward, across steps
        # every prompt row must carry these (checked with the data, before training starts)
        self.required_fields = tuple(dict.fromkeys(
            f for _, fn, _ in self.components for f in getattr(fn, "required_fields", ())))

    def score(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]],
              wheres: list[str] | None = None) -> Scores:
        """Score sample i (prompts[i], completions[i], rows[i]); `wheres[i]` names its data row
        (`file:line`) in messages."""
        n = len(completions)
        wheres = wheres or [f"sample {i}" for i in range(n)]
        components: dict[str, list[float | None]] = {}
        info: dict[str, list[Any]] = {}
        totals: list[float | None] = [0.0] * n
        guards: list[float | None] = [None] * n
        with routed_output():
            for name, fn, weight in self.components:
                scored = self._run(name, fn, prompts, completions, rows, wheres)
                values = [v for v, _ in scored]
                for key in dict.fromkeys(k for _, notes in scored for k in notes):
                    info[f"{name}/{key}"] = [notes.get(key) for _, notes in scored]
                if getattr(fn, "is_guard", False):
                    for i, v in enumerate(values):
                        if v:  # fired (non-zero); None means the guard itself could not decide
                            guards[i] = v if isinstance(v, float) else sum(p or 0.0 for p in v.values())
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
        spread = self._disagreement(info, n)
        if spread is not None:
            info["disagreement"] = spread
        if self.warn is not None:
            for line in self.take_report()[1]:
                self.warn(line)
        return Scores(totals, components, info)

    def _disagreement(self, info: dict[str, list[Any]], n: int) -> list[float | None] | None:
        """Per sample, how uncertain the total is: the sum over components reporting a
        `disagreement` note (an ensemble's std across its members) of |weight| x that note, in the
        total's units. A sum, because the std of a sum is at most the sum of the stds whatever the
        components' correlation. None when no component reports one."""
        terms = [(abs(w), info[f"{name}/disagreement"]) for name, fn, w in self.components
                 if f"{name}/disagreement" in info and not getattr(fn, "is_guard", False)]
        if not terms:
            return None
        out: list[float | None] = []
        for i in range(n):
            parts = [(w, d[i]) for w, d in terms]
            out.append(None if any(not isinstance(d, (int, float)) for _, d in parts) else
                       sum(w * float(d) for w, d in parts))
        return out

    def take_report(self) -> tuple[dict[str, float], list[str]]:
        """Since the last report: `reward/timeouts` and `reward/errors` (calls counted as
        unverifiable), and one warning line per reward that timed out, failed, printed more than
        is shown, or changed the working directory."""
        tallies, self._tally = self._tally, {}
        metrics = {"reward/timeouts": float(sum(t.timeouts for t in tallies.values())),
                   "reward/errors": float(sum(t.errors for t in tallies.values()))}
        lines = []
        for name, fn, _ in self.components:  # a reward's own report (a judge's failed requests)
            take = getattr(fn, "take_warnings", None)
            lines += [f"reward {self._label(name)}: {line}" for line in (take() if take is not None else [])]
        for name, t in tallies.items():
            label = f"reward {self._label(name)}"
            if t.timeouts:
                lines.append(f"{label} timed out on {t.timeouts} of {t.calls} calls (scoring.timeout_s="
                             f"{self.timeout_s:g}; first on {t.first_timeout}); counted as unverifiable")
            if t.errors:
                lines.append(f"{label} failed on {t.errors} of {t.calls} calls (first on {t.first_error}); counted "
                             "as unverifiable (scoring.on_reward_error=unverifiable)")
            if t.output_dropped:
                lines.append(f"{label} printed {t.output_dropped:,} more characters than the "
                             f"{CappedOutput().limit:,} shown per scoring call; the rest was not shown")
            if t.cwd_changed_to:
                lines.append(f"{label} changed the working directory (to {t.cwd_changed_to}); rlft changed it "
                             "back. Rewards run inside the trainer: use absolute paths instead of os.chdir")
        return metrics, lines

    def _label(self, name: str) -> str:
        return self.labels.get(name, repr(name))

    # -- one component ------------------------------------------------------------------------
    def _run(self, name: str, fn: RewardFn, prompts, completions, rows, wheres) -> list[_Judged]:
        tally = self._tally.setdefault(name, _Tally())
        output, cwd, n = CappedOutput(), os.getcwd(), len(completions)
        values: list[_Judged] = [(None, {})] * n

        def settle(i: int, out: Outcome) -> None:
            values[i] = self._judge(name, fn, out, wheres[i])

        try:
            batch = getattr(fn, "batch", None)
            if batch is not None:  # one call for all samples, with all of their time
                [out] = call_all([lambda: batch(prompts, completions, rows)], 1, self.timeout_s * max(n, 1),
                                 self.should_stop, output=output)
                return self._judge_batch(name, fn, out, wheres)
            thunks = [functools.partial(_call_one, fn, prompts[i], completions[i], rows[i]) for i in range(n)]
            call_all(thunks, self.max_workers, self.timeout_s, self.should_stop, settle, output)
            return values
        finally:
            tally.output_dropped += output.dropped
            if os.getcwd() != cwd:
                tally.cwd_changed_to = os.getcwd()
                os.chdir(cwd)

    def _judge_batch(self, name: str, fn: RewardFn, out: Outcome, wheres: list[str]) -> list[_Judged]:
        if out.error is not None or out.timed_out:
            return [self._judge(name, fn, out, w) for w in wheres]
        values = out.value
        if not isinstance(values, (list, tuple)) or len(values) != len(wheres):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            self._fail(name, f"'s batch() returned {got} for {len(wheres)} rows (first: {wheres[0]}); it must "
                             "return one value per row", force_stop=True)
        return [self._judge(name, fn, Outcome(value=v), w) for v, w in zip(values, wheres)]

    def _judge(self, name: str, fn: RewardFn, out: Outcome, where: str) -> _Judged:
        """(the call's value, its notes); None (unverifiable) for a timed-out call; a failed call
        stops the run or counts as unverifiable, as scoring.on_reward_error says."""
        tally = self._tally[name]
        tally.calls += 1
        if out.timed_out:
            tally.timeouts += 1
            tally.first_timeout = tally.first_timeout or where
            self._streak[name] = self._streak.get(name, 0) + 1
            limit = self.max_consecutive_timeouts
            if limit is not None and self._streak[name] >= limit:
                raise RewardError(
                    f"reward {self._label(name)} timed out on {self._streak[name]} calls in a row (scoring.timeout_s="
                    f"{self.timeout_s:g}; the last on {where}), scoring.max_consecutive_timeouts={limit}: it hangs "
                    "or is far too slow.\nFix: run it by hand on that row to see where it waits, or raise "
                    "scoring.timeout_s if it is only slow")
            return None, {}
        self._streak[name] = 0
        if isinstance(out.error, RlftError):  # a set-up problem (a judge's wrong URL): the same for every row,
            raise RewardError(f"reward {self._label(name)}: {out.error}")  # and its message has the fix
        if out.error is not None:
            detail = describe_exception(out.error, getattr(fn, "user_file", None))
            self._fail(name, f" raised on {where}:\n{indent(detail)}", short=f"{where}: {detail.splitlines()[0]}")
            return None, {}
        raw, notes = unwrap(out.value)
        bad_notes = check_info(notes)
        if bad_notes is not None:
            self._fail(name, f" returned a Scored for {where} whose notes cannot be logged: {bad_notes}",
                       short=f"{where}: {bad_notes}")
            return None, {}
        value, problem = as_reward_value(raw)
        if problem is None:
            problem = self._out_of_scale(value)
        if problem is None:
            return value, notes
        returned, why = problem
        why = f": {why}" if why else ""
        self._fail(name, f" returned {returned} for {where}{why}.\nA reward returns {ALLOWED_VALUES}",
                   short=f"{where}: returned {returned}")
        return None, notes

    def _out_of_scale(self, value: RewardValue) -> tuple[str, str] | None:
        """A finite value beyond scoring.max_abs_reward (a raw count, a missing scale): as a reward
        error, since it would swamp every other component and, without std division (Dr. GRPO),
        turn each update into a sign."""
        bound = self.max_abs_reward
        parts = value.values() if isinstance(value, dict) else [value]
        big = next((v for v in parts if v is not None and abs(v) > bound), None) if bound is not None else None
        if big is None:
            return None
        return (f"{big:g}" if not isinstance(value, dict) else f"dict with a part of {big:g}",
                f"beyond scoring.max_abs_reward={bound:g} (rewards are expected in a small fixed range such as "
                "0..1; rescale the reward, or raise scoring.max_abs_reward if such values are meant)")

    def _fail(self, name: str, problem: str, short: str = "", force_stop: bool = False) -> None:
        if self.on_error == "stop" or force_stop:
            raise RewardError(f"reward {self._label(name)}{problem}\nFix: correct the reward for this row, or set "
                              "scoring.on_reward_error=unverifiable to count the rows it fails on as unverifiable "
                              "(None) and go on")
        tally = self._tally[name]
        tally.errors += 1
        tally.first_error = tally.first_error or short


def _call_one(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]) -> RewardValue:
    return fn(prompt, completion, **_private_copy(_row_kwargs(row)))


def _private_copy(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of the row down to its innermost lists: the same row object serves every sample of a
    prompt, every reward and every epoch, so a reward that edits `messages` or `tests` in place
    would change what all later calls see. (A pickle round trip copies JSON-like data several
    times faster than deepcopy.)"""
    try:
        return pickle.loads(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001  (an unpicklable field: the slower general copy)
        return copy.deepcopy(row)


def _row_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The row as keyword arguments; `prompt` / `completion` are the positional ones."""
    if "prompt" in row or "completion" in row:
        return {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    return row


def _split(name: str, value: RewardValue) -> tuple[float | None, dict[str, float | None]]:
    """A checked value (see user_code.as_reward_value) as (component value, named parts)."""
    if isinstance(value, dict):
        parts = {f"{name}/{k}": v for k, v in value.items()}
        total = None if any(v is None for v in parts.values()) else sum(parts.values())
        return total, parts
    return value, {}


def _check_code_time_limit(specs: list[RewardSpec], timeout_s: float, max_workers: int) -> None:
    """The `code` reward bounds its own program (its `timeout` plus the sandbox's start-up grace)
    and waits for a free sandbox when more calls run than sandboxes may (MAX_CONCURRENT): the
    per-call time limit must cover both, or a slow but legitimate program would be cut off as
    'unverifiable' instead of scored by the sandbox as a timeout."""
    for i, spec in enumerate(specs):
        if spec.fn != "code":
            continue
        from rlft.rewards.code.sandbox import (  # lazy: rlft.rewards.code's reward imports this module
            MAX_CONCURRENT,
            STARTUP_GRACE_S,
        )

        default = inspect.signature(BUILTIN_REWARDS["code"]).parameters["timeout"].default
        program = float(spec.args.get("timeout", default))
        waves = math.ceil(max_workers / MAX_CONCURRENT)
        needed = waves * (program + STARTUP_GRACE_S)
        if timeout_s < needed:
            raise ConfigError(
                f"scoring.timeout_s={timeout_s:g} is shorter than rewards[{i}] (code) may take: its program timeout "
                f"{program:g}s + {STARTUP_GRACE_S:g}s sandbox start-up, times {waves} for waiting on a free sandbox "
                f"({max_workers} workers, {MAX_CONCURRENT} sandboxes at once) = {needed:g}s.\n"
                f"Fix: set scoring.timeout_s={math.ceil(needed)} or more, or lower the code reward's timeout")


def _check_declared_time(built: list[tuple[str, RewardFn]], timeout_s: float) -> None:
    """A reward that declares how long one sample may take (`fn.longest_call_s`: an LLM judge's
    attempts, time limits and back-off) must fit in scoring.timeout_s; else a slow but working
    endpoint would be cut off as unverifiable before the reward's own retries could run."""
    for i, (name, fn) in enumerate(built):
        needed = getattr(fn, "longest_call_s", None)
        if needed is not None and timeout_s < needed:
            why = getattr(fn, "longest_call_why", "")
            raise ConfigError(
                f"scoring.timeout_s={timeout_s:g} is shorter than rewards[{i}] ({name!r}) may take per sample: "
                f"{needed:g}s{f' ({why})' if why else ''}.\nFix: set scoring.timeout_s={math.ceil(needed)} or more, "
                "or lower that reward's timeout_s or max_retries")


def build_scorer(rewards: list[RewardSpec], scoring: ScoringConfig | None = None, *,
                 should_stop: Callable[[], bool] | None = None,
                 warn: Callable[[str], None] | None = log.warning, where: str = "rewards") -> RewardScorer:
    """The one way to build a scorer from config (training, evaluation, suites, comparisons,
    data screening): the `rewards:` list under the `scoring:` section's limits.

    `should_stop` is polled while calls run (a Ctrl-C); `warn=None` keeps warning lines for
    `take_report()` (the online loop prints them once per step); `where`: the list in the config
    (`eval.suites[0].rewards`), named in errors."""
    sc = scoring or ScoringConfig()
    return RewardScorer(rewards, sc.max_workers, timeout_s=sc.timeout_s,
                        max_consecutive_timeouts=sc.max_consecutive_timeouts, on_error=sc.on_reward_error,
                        should_stop=should_stop, warn=warn, max_abs_reward=sc.max_abs_reward, where=where)
