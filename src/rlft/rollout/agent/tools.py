"""Tools for multi-turn rollouts: plain Python functions, their JSON schemas, and running a call
under limits.

A tool is `fn(**arguments) -> str` with type hints and a Google-style docstring (its description
and one `Args:` line per parameter); its schema for the chat template comes from them
(`transformers.utils.get_json_schema`). Config names tools like rewards: a built-in name
(`calculator`), `module:function` or `path/file.py:function`.

A call never stops the run. Each failure becomes an error observation the model reads, counted by
kind (ERROR_KINDS). Each call runs in its own daemon thread with a time limit: a tool that hangs is
abandoned (its thread keeps running in the background until it returns; Python cannot kill it),
and the episode goes on with a `timeout` observation. The calls of one round of turns run
concurrently (one thread each), so a tool that keeps state must be thread-safe.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from rlft.errors import ConfigError
from rlft.rewards.user_code import load_user_function

# Why a call failed; each is a counter (`agent/errors/<kind>`) and an observation starting "Error:".
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "bad_result", "too_many_calls")
# what ends an agent.program episode (rollout/agent/program.py), counted beside the tools' errors
PROGRAM_ERRORS = ("program_raised", "program_timeout", "program_no_call")
EPISODE_ERRORS = ERROR_KINDS + PROGRAM_ERRORS


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}


@dataclass
class ToolResult:
    text: str  # what the model reads (an error observation when `error` is set)
    error: str | None = None  # one of ERROR_KINDS
    seconds: float = 0.0


# -- the built-in calculator -------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 100  # 9**9**9 would take minutes and gigabytes; no arithmetic task needs more


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(37 + 48) * 2".
    """
    # parsed and walked, never eval'd: only numbers and arithmetic operators are accepted
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    return str(value)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


# -- loading -----------------------------------------------------------------------------------

def tool_schema(fn: Callable[..., Any], ref: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001  (transformers' own DocstringParsing/TypeHintParsing exceptions)
        raise ConfigError(f"agent.tools: {ref}: {exc}\nA tool needs a type hint on every parameter and a "
                          "docstring with a description and an 'Args:' line per parameter (as `calculator` in "
                          "rlft/rollout/agent/tools.py)") from None


def load_tools(refs: list[str]) -> list[Tool]:
    """Tools from config references, checked: a schema for each, names unique."""
    tools = []
    for ref in refs:
        fn = BUILTIN_TOOLS.get(ref) or (load_user_function(ref, what="tool") if ":" in ref else None)
        if fn is None:
            raise ConfigError(f"agent.tools: unknown tool {ref!r}; built-ins: {', '.join(BUILTIN_TOOLS)}, or "
                              "'module:function' / 'path/file.py:function'")
        schema = tool_schema(fn, ref)
        tools.append(Tool(schema["function"]["name"], fn, schema))
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"agent.tools: two tools are named {dupes[0]!r}; the model calls tools by name, so "
                          "names must be unique (rename one of the functions)")
    return tools


# -- running one call --------------------------------------------------------------------------

def _as_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float, list, dict)):  # plain data: as JSON; None and objects are errors
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return None
    return None


def start_call(tools: dict[str, Tool], name: str, arguments: Any) -> "PendingCall":
    """Check the call and start it in its own thread; `PendingCall.result(deadline)` collects it."""
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(tools) or "none"
        return PendingCall(ToolResult(f"Error: unknown tool {name!r}; available tools: {known}", "unknown_tool"))
    if not isinstance(arguments, dict):
        return PendingCall(ToolResult(f"Error: arguments of {name} must be a JSON object", "bad_arguments"))
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return PendingCall(ToolResult(f"Error: bad arguments for {name}: {exc}", "bad_arguments"))
    return PendingCall(None, tool, arguments)


# notified whenever any call's thread finishes: what `wait_any` sleeps on
_FINISHED = threading.Condition()


class PendingCall:
    """A call that runs in a daemon thread from construction on (or an immediate result)."""

    def __init__(self, immediate: ToolResult | None, tool: Tool | None = None, arguments: dict | None = None):
        self.immediate, self.tool = immediate, tool
        self.outcome: list[Any] = []  # [("value" | "error", payload)] once the thread finishes
        self.start = time.perf_counter()
        if immediate is None:
            assert tool is not None
            self.thread = threading.Thread(target=self._run, args=(arguments,), daemon=True,
                                           name=f"rlft-tool-{tool.name}")
            self.thread.start()

    def _run(self, arguments: dict) -> None:
        try:
            self.outcome.append(("value", self.tool.fn(**arguments)))
        except BaseException as exc:  # noqa: BLE001  (anything a tool raises is an observation)
            self.outcome.append(("error", exc))
        finally:
            with _FINISHED:
                _FINISHED.notify_all()

    def ready(self, timeout_s: float) -> bool:
        """Whether `result(timeout_s)` would answer without waiting."""
        return (self.immediate is not None or bool(self.outcome)
                or time.perf_counter() - self.start >= timeout_s)

    @staticmethod
    def wait_any(groups: list[list["PendingCall"]], timeout_s: float) -> None:
        """Sleep until every call of one of `groups` is ready (finished, or `timeout_s` past its
        start). No polling: a finishing call wakes the waiter, which checks again."""
        with _FINISHED:  # a call finishing between the check and the wait notifies after it
            while not any(all(call.ready(timeout_s) for call in group) for group in groups):
                running = [call.start for group in groups for call in group if not call.ready(timeout_s)]
                _FINISHED.wait(max(0.0, min(running) + timeout_s - time.perf_counter()))

    def result(self, timeout_s: float) -> ToolResult:
        """Wait at most until `timeout_s` after the call started."""
        if self.immediate is not None:
            return self.immediate
        name = self.tool.name
        self.thread.join(max(0.0, self.start + timeout_s - time.perf_counter()))
        seconds = time.perf_counter() - self.start
        if not self.outcome:
            return ToolResult(f"Error: {name} did not finish within {timeout_s:g} s", "timeout", seconds)
        kind, payload = self.outcome[0]
        if kind == "error":
            return ToolResult(f"Error: {name} raised {type(payload).__name__}: {payload}", "raised", seconds)
        text = _as_text(payload)
        if text is None:
            return ToolResult(f"Error: {name} returned a {type(payload).__name__}, not text", "bad_result", seconds)
        return ToolResult(text, None, seconds)
