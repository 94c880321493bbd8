"""SFT on tool-use transcripts: the cold start before RL with tools, on the tokens RL will see.

A row is a conversation in the OpenAI/HF shape: assistant messages may carry
`tool_calls: [{"type": "function", "function": {"name": ..., "arguments": {...} or a JSON string}}]`
and each call is answered by a `{"role": "tool", "name"?: ..., "content": ...}` message, in order.

Many templates drop `tool_calls` and render unknown roles as plain turns, and the ones that do
render them may not use the syntax the rollout parses. So the row is encoded the way a TurnDriver
episode of the same conversation is built, not through the template's own rendering of the calls:

    prompt ids (tools presented as in rollouts) | turn 1 text + end-of-turn | observation | turn 2 ...

each assistant turn's text is its content with the calls written in the parser's syntax (the text
a model samples and the parser reads back), then the end-of-turn token the model samples; each
observation (tool results, named after the calls they answer and cut as rollouts cut them) is
encoded by the rollout's own ObservationEncoder. The loss mask is 1 on the turns, 0 elsewhere:
exactly the episode's `loss_mask` had the model sampled these turns.

A turn whose content already holds calls in the parser's syntax (an rlft episode transcript keeps
them in both places) is used as it is; its `tool_calls`, when given, must be the same calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlft.config import AgentConfig
from rlft.data.validate import RowError
from rlft.errors import ConfigError
from rlft.models.template import Messages, encode_text
from rlft.rollout.agent.tool_calls import ParsedCall, Parser, Writer, pick_parser, pick_writer
from rlft.rollout.agent.tools import Tool, load_tools
from rlft.rollout.agent.turns import ObservationEncoder, cut_tool_output

NO_AGENT_FIX = ("set agent.tools to the tools the calls name (and agent.parser if not auto): calls and results "
                "are then rendered as rollouts parse and insert them, and the prompt shows the tools")


def has_tool_parts(messages: Messages) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def check_tool_messages(messages: list[Any]) -> Messages:
    """The tool-use parts of a row, checked and normalised (other messages pass through as they
    are): `tool_calls` become [{"type": "function", "function": {"name": str, "arguments": dict}}]
    (a JSON-string `arguments` read; null or [] means no calls), an assistant's `content` null
    beside calls becomes "", and a `tool` message must follow the turn whose call it answers."""
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RowError("malformed 'messages'", f"item {i} must be {{'role': str, 'content': str}}")
        role, calls = msg["role"], msg.get("tool_calls")
        msg = {k: v for k, v in msg.items() if k != "tool_calls"}
        if calls not in (None, []):
            if role != "assistant":
                raise RowError("malformed 'tool_calls'", f"messages[{i}] is a {role!r} message; only assistant "
                                                         "messages make tool calls")
            if not isinstance(calls, list):
                raise RowError("malformed 'tool_calls'", f"messages[{i}].tool_calls must be a list of calls, got "
                                                         f"{type(calls).__name__}")
            msg["tool_calls"] = [_check_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
            if msg.get("content") is None:  # OpenAI writes null content beside calls
                msg["content"] = ""
        if role == "tool":
            if i == 0 or out[-1]["role"] not in ("assistant", "tool"):
                raise RowError("tool message with no preceding call",
                               f"messages[{i}] is a tool result, but messages[{i - 1}] is not the assistant turn "
                               "that called it" if i else "messages[0] is a tool result with no call before it")
            if msg.get("name") is not None and not isinstance(msg["name"], str):
                raise RowError("malformed tool message", f"messages[{i}].name must be a string (the tool's name)")
        out.append(msg)
    return out


def _check_call(call: Any, where: str) -> dict[str, Any]:
    """One call, OpenAI's nested form or the flat {"name", "arguments"} one that templates also read."""
    if not isinstance(call, dict):
        raise RowError("malformed 'tool_calls'", f"{where} must be an object, got {type(call).__name__}")
    if call.get("type", "function") != "function":
        raise RowError("malformed 'tool_calls'", f"{where}.type is {call['type']!r}; only 'function' calls exist")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise RowError("tool call without a function name", f"{where} needs function.name (a string)")
    if "arguments" not in fn:
        raise RowError("tool call without arguments", f"{where}.function.arguments is missing; write {{}} for a "
                                                       "call without arguments")
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise RowError("tool call arguments are not a JSON object",
                           f"{where}.function.arguments is a string that is not JSON ({exc.msg})") from None
    if not isinstance(args, dict):
        raise RowError("tool call arguments are not a JSON object",
                       f"{where}.function.arguments must be an object or a string holding one, got "
                       f"{type(args).__name__}")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


@dataclass
class EncodedTranscript:
    input_ids: list[int]
    target_mask: list[int]  # 1 on each assistant turn's ids, its end-of-turn token included
    last_turn_start: int  # input_ids[:last_turn_start] is the context the last turn was written in
    last_text: str  # that turn's text as trained (calls written in)


class TranscriptEncoder:
    """Chat rows -> the token ids and loss mask a TurnDriver episode of the same conversation has."""

    def __init__(self, tokenizer: Any, tools: list[Tool], parser: Parser, writer: Writer,
                 max_tool_output_tokens: int, tools_prompt: str | None = None):
        self.tokenizer, self.parser, self.writer = tokenizer, parser, writer
        self.max_tool_output_tokens = max_tool_output_tokens
        self.tool_names = [t.name for t in tools]
        self.encoder = ObservationEncoder(tokenizer, [t.schema for t in tools], parser.syntax, tools_prompt)
        end_id = self.encoder.turn_end_id()
        if end_id is None:
            raise ConfigError("agent: the chat template ends assistant turns without an end-of-turn token and the "
                              "tokenizer has no EOS token, so a turn's end cannot be trained.\nFix: set "
                              "model.chat_template to one whose turns end with a special token (e.g. ChatML)")
        self.end_id = end_id

    def encode(self, messages: Messages) -> EncodedTranscript:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        prompt = messages[:turns[0]]
        ids = self.encoder.prompt_ids(prompt)
        mask = [0] * len(ids)
        start, text = 0, ""
        for k, i in enumerate(turns):
            text, calls, turn_ids = self._turn(messages[i], i)
            start = len(ids)
            ids += turn_ids
            mask += [1] * len(turn_ids)
            end = turns[k + 1] if k + 1 < len(turns) else len(messages)
            observed = self._observed(messages, i, end, calls, final=k + 1 == len(turns))
            if k + 1 < len(turns):  # nothing after the last turn is trained on or conditions a target
                obs = self.encoder.observation_ids(prompt, observed, ids[-1])
                ids += obs
                mask += [0] * len(obs)
        return EncodedTranscript(ids, mask, start, text)

    def _turn(self, msg: dict[str, Any], i: int) -> tuple[str, list[ParsedCall], list[int]]:
        """An assistant turn's text (its calls written in), the calls, and its ids as sampled."""
        content = msg["content"]
        given = [ParsedCall(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
        written = self.parser(content)
        bad = next((c for c in written if c.error is not None), None)
        if bad is not None:
            raise RowError("unreadable tool call in an assistant message",
                           f"messages[{i}].content holds {bad.raw[:60]!r}, which the {self.parser.__name__} parser "
                           "cannot read as a call; fix it or move the call to tool_calls")
        if written:  # the text as a model writes it: used as it is
            if given and [(c.name, c.arguments) for c in given] != [(c.name, c.arguments) for c in written]:
                raise RowError("tool_calls differ from the calls in the content",
                               f"messages[{i}]: the content calls {[c.name for c in written]}, tool_calls says "
                               f"{[c.name for c in given]}; keep the calls in one place")
            text, calls = content, written
        else:
            try:
                text, calls = self.writer(content, given), given
            except ValueError as exc:
                raise RowError("a turn the call syntax cannot express", f"messages[{i}]: {exc}") from None
        unknown = next((c.name for c in calls if c.name not in self.tool_names), None)
        if unknown is not None:
            raise RowError("call to a tool not in agent.tools",
                           f"messages[{i}] calls {unknown!r}; agent.tools has {self.tool_names}: add the tool there, "
                           "or fix the row")
        ids = encode_text(self.tokenizer, text)
        if any(t in self.encoder.eot_ids for t in ids):  # a sampled turn stops there; it never holds one
            raise RowError("end-of-turn token inside an assistant message",
                           f"messages[{i}].content holds a token that ends a turn; remove it")
        return text, calls, ids + [self.end_id]

    def _observed(self, messages: Messages, i: int, end: int, calls: list[ParsedCall], final: bool) -> Messages:
        """What follows turn `i` until the next one: its tool results, named after the calls they
        answer (one per call, in order, as rollouts insert them) and cut as rollouts cut them, then
        any other messages."""
        after = messages[i + 1:end]
        results = [m for m in after if m["role"] == "tool"]  # they come first (check_tool_messages)
        if results and not calls:
            raise RowError("tool message with no preceding call",
                           f"messages[{i + 1}] is a tool result, but messages[{i}] makes no call")
        if len(results) != len(calls) and (results or not final):
            raise RowError("tool results do not match the calls",
                           f"messages[{i}] makes {len(calls)} call(s) and {len(results)} tool message(s) follow "
                           "it; each call gets one result, in order, as in rollouts")
        observed = []
        for k, (call, result) in enumerate(zip(calls, results)):
            if result.get("name") not in (None, call.name):
                raise RowError("tool result named after another tool",
                               f"messages[{i + 1 + k}] is named {result['name']!r} but answers the call to "
                               f"{call.name!r} (results follow the calls' order)")
            observed.append({"role": "tool", "name": call.name,
                             "content": cut_tool_output(self.tokenizer, result["content"],
                                                        self.max_tool_output_tokens)})
        return observed + after[len(results):]


def tool_transcripts(cfg: AgentConfig, tokenizer: Any) -> Any:
    """SFT's view of `agent`: the tools it presents and the call syntax it writes, as rollouts do."""
    return TranscriptEncoder(tokenizer, load_tools(cfg.tools), pick_parser(cfg.parser, tokenizer.chat_template),
                             pick_writer(cfg.parser, tokenizer.chat_template), cfg.max_tool_output_tokens,
                             cfg.tools_prompt)
