"""Tool-use transcripts for the word-problem demo, written by a sloppy annotator: SFT data for a
cold start before RL with the calculator (`rlft demo --tools`, demo/tool_use.py).

Some traces call the calculator on the problem's expression, read the result and answer with it;
the others skip the tool and guess, and a guess is often wrong by the slips people make (a carry
dropped or added, one group too many or too few in a product). SFT on them teaches the call
syntax and the answer format but not *when* to call; the wrong guesses leave room for RL, whose
`math` reward pays only right answers, to learn that calling pays. The tool results are the
built-in calculator's own output, so a trace shows exactly what a rollout would.

Rows are SFT rows in the OpenAI/HF tool-use shape (see data/tool_transcripts.py) and keep the
problem's fields (`answer`, `op`, `a`, `b`) plus `trace`: 'call', 'guess_right' or 'guess_wrong'.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rlft.rollout.agent.tools import calculator

# Replaces the demo's system prompt (whose worked example never calls) in tool-use prompts.
TOOL_SYSTEM_PROMPT = ("Solve the math problem. You can use the calculator. End with the final answer, e.g. "
                      "\"12 + 5 = 17. The answer is 17.\"")
LEAD_INS = ("", "Let me compute that.", "I'll use the calculator.")


@dataclass(frozen=True)
class Annotator:
    """How often the annotator uses the calculator, how often a guess without it is right, and the
    sentences it may write before a call (one drawn per call; "" writes the call alone), and how it
    writes the final answer (with {expression} and {value} filled in): `answer`, or after a call
    `answer_after_call` when given."""

    call_rate: float = 0.3
    guess_accuracy: float = 0.6
    lead_ins: tuple[str, ...] = LEAD_INS
    answer: str = "{expression} = {value}. The answer is {value}."
    answer_after_call: str | None = None

    def __post_init__(self) -> None:
        for name in ("call_rate", "guess_accuracy"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Annotator.{name} must be in [0, 1], got {getattr(self, name)}")


def tool_prompts(rows: list[dict[str, Any]], system: str = TOOL_SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The demo's prompt rows (word_problems.make_rows) with the tool-use system prompt."""
    return [{**row, "prompt": [{"role": "system", "content": system}, row["prompt"][-1]]} for row in rows]


def slip(rng: random.Random, op: str, a: int, b: int, right: int) -> int:
    """A plausible wrong answer: a carry or borrow off by ten, an off-by-one, or in a product one
    group of `a` too many or too few; never the right answer, never negative."""
    offsets = [10, -10, 1, -1] + ([a, -a] if op == "*" else [])
    choices = [right + d for d in offsets if right + d >= 0]
    return rng.choice(choices)


def sloppy_trace(rng: random.Random, row: dict[str, Any], annotator: Annotator) -> dict[str, Any]:
    """One transcript for one prompt row (system + user messages, `op`, `a`, `b`, `answer`)."""
    op, a, b = row["op"], row["a"], row["b"]
    expression = f"{a} {op} {b}"
    right = int(row["answer"])
    messages = list(row["prompt"])
    if rng.random() < annotator.call_rate:
        result = calculator(expression)  # the tool's own output, as a rollout would insert it
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages += [{"role": "assistant", "content": rng.choice(annotator.lead_ins), "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": result}]
        value, trace = int(result), "call"
    elif rng.random() < annotator.guess_accuracy:
        value, trace = right, "guess_right"
    else:
        value, trace = slip(rng, op, a, b, right), "guess_wrong"
    form = annotator.answer_after_call if trace == "call" and annotator.answer_after_call else annotator.answer
    messages.append({"role": "assistant", "content": form.format(expression=expression, value=value)})
    fields = {k: v for k, v in row.items() if k != "prompt"}
    return {"messages": messages, **fields, "trace": trace}


def sloppy_traces(rows: list[dict[str, Any]], seed: int = 0, annotator: Annotator = Annotator(),
                  system: str = TOOL_SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """A transcript per prompt row, deterministic by seed, prompted with `system`."""
    rng = random.Random(seed)
    return [sloppy_trace(rng, row, annotator) for row in tool_prompts(rows, system)]
