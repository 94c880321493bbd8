"""A tiny model that uses the calculator, for end-to-end tests of multi-turn episodes.

A random tiny model never writes a tool call. This one is the tiny Qwen2 trained (plain next-token
loss on the assistant turns, a few seconds) on whole episodes for a handful of sums:

    user: What is 37 + 48?  ->  <tool_call>{"name": "calculator", ...}</tool_call>  ->  tool: 85
                            ->  The answer is 85.

so that greedy decoding replays them: one well-formed call, then the right answer. Its chat template
renders tools natively in one short system line (a template's own `tools=` support), which keeps
the sequences short enough to train on in seconds; the episodes it is trained on are built by the
TurnDriver's own ObservationEncoder, so what it learned is what the driver will show it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SUMS = [(37, 48), (12, 9), (25, 61), (7, 70)]
TEMPLATE_TOOLS = ("{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | "
                  "map(attribute='name') | join(', ') }}<|im_end|>\n{%- endif %}")


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def call_text(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}) + "</tool_call>"


def answer_text(a: int, b: int) -> str:
    return f"The answer is {a + b}."


def prompt_rows() -> list[dict]:
    """The sums as prompt rows (`answer`: the gold number)."""
    return [{"prompt": question(a, b), "answer": str(a + b)} for a, b in SUMS]


def _episode(encoder, tokenizer, a: int, b: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of one whole episode, labels -100 outside the assistant turns."""
    from rlft.models.template import encode_text

    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = [{"role": "user", "content": question(a, b)}]
    first = encode_text(tokenizer, call_text(a, b)) + [eot]
    observation = encoder.observation_ids(prompt, [{"role": "tool", "name": "calculator", "content": str(a + b)}], eot)
    second = encode_text(tokenizer, answer_text(a, b)) + [eot]
    start = encoder.prompt_ids(prompt)
    return start + first + observation + second, [-100] * len(start) + first + [-100] * len(observation) + second


def build_calculator_model(out: Path, steps: int = 600, seed: int = 0) -> Path:
    """Train the tiny model on the SUMS episodes until greedy decoding replays them, save it to `out`."""
    from rlft.models.tiny import CHATML_TEMPLATE, build_tiny_model
    from rlft.rollout.agent.tools import load_tools
    from rlft.rollout.agent.turns import ObservationEncoder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(out, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE_TOOLS + CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    encoder = ObservationEncoder(tokenizer, [t.schema for t in load_tools(["calculator"])])
    assert encoder.native_tools
    rows = [_episode(encoder, tokenizer, a, b) for a, b in SUMS]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [B, T], right-padded
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros_like(ids)
    for r, (x, y) in enumerate(rows):
        ids[r, :len(x)], labels[r, :len(y)], attention[r, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    mask = labels[:, 1:] != -100  # [B, T-1]: the assistant tokens, as next-token targets
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:].clamp(min=0), reduction="none")
        worst = float(nll[mask].max().detach())
        if worst < 0.05:  # every token above probability 0.95: greedy decoding replays the episodes
            break
        (nll[mask].mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        raise AssertionError(f"the calculator model did not learn its episodes (worst token NLL {worst:.3f})")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
