"""Tool-call syntax: parsers (an assistant turn's text in, the calls it makes out) and writers (the
reverse, for SFT transcripts whose calls come as structured `tool_calls`).

Each model family writes calls its own way; a parser is `fn(text) -> list[ParsedCall]`, registered
by name with `syntax`, the sentence rlft's own prompt block uses to teach the format (for a
template without tool support). `agent.parser: auto` picks one from the chat template's source. A
call that cannot be read is still returned (with `error='malformed'`), so the model is told, and it
is counted. A writer is `fn(content, calls) -> text`, registered under its parser's name: the text
a model of that family writes for such a turn, which the parser reads back to the same calls; it
raises ValueError for a turn the syntax cannot express.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rlft.errors import ConfigError


@dataclass
class ParsedCall:
    name: str = ""
    arguments: Any = None
    error: str | None = None  # 'malformed' when the call's text is not a readable call
    raw: str = ""


class Parser(Protocol):
    syntax: str  # completes "To call a tool, ..." in the prompt block (rollout/agent/turns.py TOOLS_BLOCK)

    def __call__(self, text: str) -> list[ParsedCall]: ...


Writer = Callable[[str, list[ParsedCall]], str]
PARSERS: dict[str, Parser] = {}
WRITERS: dict[str, Writer] = {}


def register_parser(name: str, syntax: str) -> Callable[[Callable[[str], list[ParsedCall]]], Parser]:
    def wrap(fn: Callable[[str], list[ParsedCall]]) -> Parser:
        fn.syntax = syntax  # type: ignore[attr-defined]
        PARSERS[name] = fn  # type: ignore[assignment]
        return fn  # type: ignore[return-value]

    return wrap


def register_writer(name: str) -> Callable[[Writer], Writer]:
    def wrap(fn: Writer) -> Writer:
        WRITERS[name] = fn
        return fn

    return wrap


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_parser("hermes", syntax='write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>')
def hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number per turn. An unclosed tag at the end of the turn is a malformed call."""
    calls = []
    for match in _HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_from_json(body, match.group(0)) if closed else
                     ParsedCall(error="malformed", raw=match.group(0)))
    return calls


@register_writer("hermes")
def write_hermes(content: str, calls: list[ParsedCall]) -> str:
    """The content, then each call on lines of its own, as Qwen2.5's template renders `tool_calls`
    (the JSON as its `tojson` writes it: non-ASCII kept), so a Qwen model is trained on its own habit."""
    parts = [content] if content else []
    parts += ["<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
              + "\n</tool_call>" for c in calls]
    return "\n".join(parts)


def _from_json(body: str, raw: str) -> ParsedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return ParsedCall(error="malformed", raw=raw)
    return _from_object(obj, raw)


def _from_object(obj: Any, raw: str) -> ParsedCall:
    """`{"name": str, "arguments" | "parameters": object}`; arguments given as a JSON string are
    read too (some models emit OpenAI's string form)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(error="malformed", raw=raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParsedCall(obj["name"], error="malformed", raw=raw)
    return ParsedCall(obj["name"], args, raw=raw)


PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("parameters" in obj or "arguments" in obj)


@register_parser("llama3_json", syntax='write only {"name": <tool name>, "parameters": <JSON object>} (several '
                                       'calls separated by ";")')
def llama3_json(text: str) -> list[ParsedCall]:
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole turn is `{"name": ..., "parameters": {...}}`,
    optionally after `<|python_tag|>`, several separated by `;`. A turn that does not start with
    a JSON object, or whose first object is not call-shaped (a name and parameters/arguments), is
    an answer: a model asked for JSON output must not have its answer run as a call. Once a turn
    is a call (tagged, or a call-shaped first object, or unreadable JSON naming a "name"), what
    cannot be read is a malformed call, trailing prose included."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body[len(PYTHON_TAG):].lstrip() if tagged else body
    if not body.startswith("{"):
        return [ParsedCall(error="malformed", raw=text)] if tagged and body else []
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            if not (tagged or calls or '"name"' in body[pos:]):
                return []  # prose that happens to open with a brace
            return calls + [ParsedCall(error="malformed", raw=body[pos:])]
        if not _is_call(obj):
            if not (tagged or calls):
                return []  # an ordinary JSON answer
            calls.append(ParsedCall(error="malformed", raw=body[pos:end]))
        else:
            calls.append(_from_object(obj, body[pos:end]))
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return calls + [ParsedCall(error="malformed", raw=rest)]
        rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return calls


@register_writer("llama3_json")
def write_llama3_json(content: str, calls: list[ParsedCall]) -> str:
    """The calls alone, `{"name": ..., "parameters": {...}}` as the Llama 3.1 template renders one,
    several joined by "; ". A turn that calls is nothing but calls in this syntax (the parser
    takes a turn with text before its call for an answer), so text beside calls cannot be written."""
    if not calls:
        return content
    if content.strip():
        raise ValueError("in the llama3_json syntax a turn that calls a tool holds only the calls; move the text "
                         "to a turn of its own or drop it")
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)


# The Llama 3.x templates tell the model (and render past calls) as {"name": ..., "parameters": ...}
_LLAMA3_CALL = re.compile(r'"name".{0,160}?"parameters"', re.DOTALL)


def detect_parser(chat_template: str | None) -> str:
    """The parser whose call syntax the template's source mentions; hermes when none does."""
    source = chat_template or ""
    if "<tool_call>" in source:
        return "hermes"
    if PYTHON_TAG in source or _LLAMA3_CALL.search(source):
        return "llama3_json"
    return "hermes"


def _family(name: str, chat_template: str | None) -> str:
    """`auto`: `detect_parser`; a template that mentions no known syntax gets Hermes (rlft then
    describes that syntax in the prompt itself)."""
    if name == "auto":
        name = detect_parser(chat_template)
    if name not in PARSERS:
        raise ConfigError(f"agent.parser: unknown parser {name!r}; known: auto, {', '.join(PARSERS)}")
    return name


def pick_parser(name: str, chat_template: str | None) -> Parser:
    return PARSERS[_family(name, chat_template)]


def pick_writer(name: str, chat_template: str | None) -> Writer:
    """The writer of the syntax `pick_parser` reads, for the same arguments."""
    return WRITERS[_family(name, chat_template)]
