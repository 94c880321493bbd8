"""Tool-call parsers: an assistant turn's text in, the calls it makes out.

Each model family writes calls its own way; a parser is `fn(text) -> list[ParsedCall]`, registered
by name, and `agent.parser: auto` picks one from the chat template's source. A call that cannot be
read is still returned (with `error='malformed'`), so the model is told, and it is counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from rlft.errors import ConfigError


@dataclass
class ParsedCall:
    name: str = ""
    arguments: Any = None
    error: str | None = None  # 'malformed' when the call's text is not a readable call
    raw: str = ""


Parser = Callable[[str], list[ParsedCall]]
PARSERS: dict[str, Parser] = {}


def register_parser(name: str) -> Callable[[Parser], Parser]:
    def wrap(fn: Parser) -> Parser:
        PARSERS[name] = fn
        return fn

    return wrap


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_parser("hermes")
def hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number per turn. An unclosed tag at the end of the turn is a malformed call."""
    calls = []
    for match in _HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_from_json(body, match.group(0)) if closed else
                     ParsedCall(error="malformed", raw=match.group(0)))
    return calls


def _from_json(body: str, raw: str) -> ParsedCall:
    """`{"name": str, "arguments": object}`; arguments given as a JSON string are read too (some
    models emit OpenAI's string form)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return ParsedCall(error="malformed", raw=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(error="malformed", raw=raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParsedCall(obj["name"], error="malformed", raw=raw)
    return ParsedCall(obj["name"], args, raw=raw)


def pick_parser(name: str, chat_template: str | None) -> Parser:
    """`auto`: the family whose call syntax the template mentions; Hermes when it mentions none
    (rlft then describes that syntax in the prompt itself)."""
    if name == "auto":
        name = "hermes"  # the only family registered so far; Llama-3 JSON would be detected by '<|python_tag|>'
    if name not in PARSERS:
        raise ConfigError(f"agent.parser: unknown parser {name!r}; known: auto, {', '.join(PARSERS)}")
    return PARSERS[name]
