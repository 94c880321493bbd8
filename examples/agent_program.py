"""An agent loop of your own, trained by rlft (agent.program: examples/agent_program.py:run).

It talks to the policy through the OpenAI client rlft hands it, offers a calculator through the
OpenAI tools API, runs the calls the model makes, and asks again until the model answers without
a call (at most three times). It returns reward components: `correct` (the last answer has the
row's answer in it) and `tool_used`. rlft records every call and trains on exactly what was
sampled; this file knows nothing about training.
"""

import ast
import json
import operator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * /")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


async def run(client, row):
    messages = list(row["messages"])
    used = 0.0
    answer = ""
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as it came: one exact sequence
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except json.JSONDecodeError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
            used = 1.0
    return {"correct": float(str(row.get("answer", "")) in answer), "tool_used": used}
