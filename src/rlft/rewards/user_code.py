"""User reward functions: loaded from `module:function` or `file.py:function`, their signatures
checked before training starts, and their values and failures checked and described in the user's
terms (their file and line, not the trainer's thread pool).

The contract is `fn(prompt, completion, **row)`, one sample per call. A function may name the row
fields it reads instead of taking `**row` (`def f(prompt, completion, answer)`): it then gets only
those fields.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import reprlib
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable

from rlft.errors import ConfigError

# added to every row by the scorer (scoring.scoring_row), so never required from the data
# (`turns`, `tool_calls`, `tool_errors`: multi-turn runs with `agent` only; `env_*`: with agent.environment)
SCORING_FIELDS = ("finish_reason", "completion_tokens", "max_new_tokens", "messages", "rendered_prompt", "turns",
                  "tool_calls", "tool_errors", "env_rewards", "env_done", "env_final", "program_reward", "program_ok")
ALLOWED_VALUES = ("a float (int and bool count as numbers), None (cannot verify) or a dict of floats (or one of "
                  "those as Scored(value, info), with notes to log)")


def load_user_function(ref: str, what: str = "reward") -> Callable[..., Any]:
    """Import `package.module:function` or `path/to/file.py:function`."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{what} {ref!r}: write it as 'module:function' or 'path/file.py:function'")
    if target.endswith(".py"):
        module = _import_file(Path(target), ref, what)
    else:
        module = _import_module(target, ref, what)
    if not hasattr(module, attr):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__]
        import difflib

        guess = difflib.get_close_matches(attr, public, n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else (f" It defines: {', '.join(public[:10])}" if public else "")
        raise ConfigError(f"{what} {ref!r}: {target} has no function {attr!r}.{hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{what} {ref!r}: {attr} in {target} is a {type(fn).__name__} ({reprlib.repr(fn)}), "
                          "not a function")
    return fn


def _import_file(path: Path, ref: str, what: str) -> Any:
    if path.is_dir():
        raise ConfigError(f"{what} {ref!r}: {path} is a folder, not a Python file; name the .py file that "
                          "defines the function")
    if not path.is_file():
        raise ConfigError(f"{what} {ref!r}: file not found: {path}")
    name = f"rlft_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        code = (exc.text or "").strip()
        raise ConfigError(f"{what} {ref!r}: {path}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
                          + (f"\n    {code}" if code else "")) from None
    except (Exception, SystemExit) as exc:  # a module that calls sys.exit() on import, too
        sys.modules.pop(name, None)
        raise ConfigError(f"{what} {ref!r}: importing {path} failed:\n"
                          + indent(describe_exception(exc, str(path.resolve())))) from None
    return module


def _import_module(target: str, ref: str, what: str) -> Any:
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        if exc.name is not None and not (target == exc.name or target.startswith(exc.name + ".")):
            # the module was found, and something it imports is missing
            raise ConfigError(f"{what} {ref!r}: importing {target} failed: {exc}") from None
        local = Path(*target.split(".")).with_suffix(".py")
        hint = (f"\nFix: {local} is in the current directory but not importable as a module; write "
                f"'{local}:{ref.rpartition(':')[2]}'" if local.is_file() else
                "\nFix: install the package, add its folder to PYTHONPATH, or write 'path/file.py:function'")
        raise ConfigError(f"{what} {ref!r}: cannot import module {target!r}: {exc}{hint}") from None
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"{what} {ref!r}: importing {target} failed:\n" + indent(describe_exception(exc))) from None


# ---------------------------------------------------------------------------------------------
# Signatures, checked when the reward is built


class Signature:
    """How a user function can be called: whether it takes `**row`, the row fields it names, and
    the ones it cannot be called without."""

    def __init__(self, takes_all: bool, names: frozenset[str], required: tuple[str, ...]):
        self.takes_all, self.names, self.required = takes_all, names, required


def check_user_function(fn: Callable[..., Any], ref: str, args: dict[str, Any]) -> Signature:
    """One ConfigError naming the reward and the fix when `fn` cannot be called as
    fn(prompt, completion, **row) with the reward's `args`."""
    def fail(problem: str, fix: str = "") -> ConfigError:
        return ConfigError(f"reward {ref!r}: {problem}\nFix: {fix or 'def ' + _name(fn) + '(prompt, completion, **row)'}")

    if inspect.isclass(fn):
        raise fail("is a class; rlft calls the reward once per sample and would only construct objects",
                   f"point at a function, or at an instance (e.g. `scorer = {fn.__name__}()` in the module "
                   "and 'file.py:scorer')")
    calls = (fn, getattr(fn, "__call__", None))  # a callable object's own __call__ too
    if any(inspect.iscoroutinefunction(c) or inspect.isasyncgenfunction(c) for c in calls):
        raise fail("is async (async def); rewards are called from worker threads and must return the value",
                   "write a plain def (use asyncio.run(...) inside it if it must await)")
    if any(inspect.isgeneratorfunction(c) for c in calls):
        raise fail("is a generator (it yields); a reward returns one value per call",
                   "return the reward instead of yielding it")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return Signature(True, frozenset(), ())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    shown = f"{_name(fn)}{inspect.signature(fn)}"
    if len(positional) < 2 and not takes_varargs:
        batch_hint = (" (batch-style functions that take lists of prompts/completions are called differently: "
                      "rlft calls once per sample)" if any(p.name.endswith("s") for p in positional) else "")
        raise fail(f"{shown} takes {len(positional)} positional parameter(s), but rewards are called as "
                   f"fn(prompt, completion, **row){batch_hint}")
    if [p.name for p in positional[:2]] == ["completion", "prompt"]:
        raise fail(f"{shown} names its parameters (completion, prompt), but the prompt comes first",
                   f"def {_name(fn)}(prompt, completion, ...)")
    if positional and positional[0].name in ("completion", "completions", "response"):  # e.g. (completion, answer, **row)
        rest = ", ".join(p.name for p in positional[1:]) + ", " if len(positional) > 1 else ""
        raise fail(f"{shown} takes the completion first, but rewards are called as fn(prompt, completion, **row): "
                   f"it would get the prompt as {positional[0].name!r}",
                   f"def {_name(fn)}(prompt, {positional[0].name}, {rest}**row)")
    stuck = [p.name for p in positional[2:] if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if stuck:
        raise fail(f"{shown}: positional-only parameter(s) {stuck} cannot receive row fields (they come as keywords)")
    named = [p for p in params[len(positional[:2]):] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = frozenset(p.name for p in named)
    if not takes_all:
        unknown = sorted(set(args) - names)
        if unknown:
            raise fail(f"args {unknown} are not parameters of {shown}",
                       "remove them from the reward's args, or add the parameters (or **row)")
    required = tuple(p.name for p in named if p.default is p.empty and p.name not in args
                     and p.name not in SCORING_FIELDS)
    return Signature(takes_all, names, required)


def wrap_user_function(fn: Callable[..., Any], args: dict[str, Any], sig: Signature) -> Callable[..., Any]:
    """The user's function as the scorer calls it: the reward's args bound, and only the row fields
    it names when it takes no **row. (The user's function object is never annotated.)"""
    if sig.takes_all:
        def call(prompt: str, completion: str, **row: Any) -> Any:
            return fn(prompt, completion, **{**row, **args})
    else:
        def call(prompt: str, completion: str, **row: Any) -> Any:
            return fn(prompt, completion, **{k: v for k, v in row.items() if k in sig.names}, **args)
    call.required_fields = sig.required
    call.user_file = source_file(fn)
    return call


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def source_file(fn: Any) -> str | None:
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        path = inspect.getsourcefile(target)
    except TypeError:
        return None
    return os.path.realpath(path) if path else None


# ---------------------------------------------------------------------------------------------
# Values and failures at run time


def as_reward_value(value: Any) -> tuple[Any, tuple[str, str] | None]:
    """(value as float | None | dict[str, float | None], None), or (None, (what was returned, why
    it is not a reward))."""
    if value is None:
        return None, None
    number = _as_number(value)
    if number is not None:
        if not math.isfinite(number):
            return None, (_show(value), "a non-finite number (return None when a sample cannot be verified)")
        return number, None
    if isinstance(value, dict):
        if not value:
            return None, ("an empty dict", "a dict reward needs at least one named part")
        parts: dict[str, float | None] = {}
        for key, part in value.items():
            if not isinstance(key, str):
                return None, (_show(value), f"the key {key!r} is a {type(key).__name__}; part names are strings")
            number = None if part is None else _as_number(part)
            if part is not None and (number is None or not math.isfinite(number)):
                return None, (_show(value), f"its part {key!r} is {_show(part)}; each part is a finite float or None")
            parts[key] = number
        return parts, None
    return None, (_show(value), _hint(value))


def _as_number(value: Any) -> float | None:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars, Fraction
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d numpy array or torch tensor
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _hint(value: Any) -> str:
    if isinstance(value, str):
        try:
            float(value)
            return "a number as text: return float(...) of it"
        except ValueError:
            return ""
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0):
        return ("rlft calls a reward once per sample and expects one value; to score a batch in one call, "
                "give the function a `batch(prompts, completions, rows)` attribute")
    if inspect.iscoroutine(value):
        value.close()  # never awaited; closed so Python does not warn about it at exit
        return "the function is async: write a plain def"
    if inspect.isgenerator(value):
        return "the function yields: return the value instead"
    return ""


_RLFT_DIR = os.path.realpath(Path(__file__).parents[1])
_LIBRARY_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                                            "platlib")})


def describe_exception(exc: BaseException, user_file: str | None = None, max_frames: int = 6) -> str:
    """The exception's last line, then the frames of the user's own code (their reward's file, or
    any file outside rlft, the standard library and installed packages), innermost last."""
    if isinstance(exc, SystemExit):
        last = f"SystemExit: the reward called sys.exit({exc.code!r}); a reward must return, not exit"
    else:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if _is_users(f.filename, user_file)] or frames[-1:]
    lines = [last]
    for f in own[-max_frames:]:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {f.line}")
    return "\n".join(lines)


def _is_users(filename: str, user_file: str | None) -> bool:
    path = os.path.realpath(filename)
    if user_file is not None and path == user_file:
        return True
    return not path.startswith(_RLFT_DIR + os.sep) and not path.startswith(_LIBRARY_DIRS) \
        and not filename.startswith("<")


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
