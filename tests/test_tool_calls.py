"""Tool-call parsers: Llama-3 JSON calls read by hand-checked cases, the parser picked from the chat
template's source, the prompt block teaching the picked parser's syntax; what a failed call does
to an episode (agent.on_tool_error)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlft.errors import ConfigError
from rlft.rollout.contract import SamplingParams
from rlft.rollout.agent.tool_calls import PARSERS, detect_parser, hermes, llama3_json, pick_parser
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, ObservationEncoder, TurnDriver, episode_metrics
from test_agents import PROMPT, ScriptedEngine, call_text, driver_for

# Written for these tests in the Llama 3.1 tool style: a system header, the instruction to answer
# with {"name": ..., "parameters": ...}, tool results in an `ipython` turn. `<|im_end|>` stands in
# for `<|eot_id|>` (the tiny tokenizer's special end-of-turn token).
LLAMA3_LIKE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] + '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Llama 3.1's built-in tools: the call follows <|python_tag|>; no JSON instruction in this one
PYTHON_TAG_ONLY = ("{%- for message in messages %}{%- if message.tool_calls %}{{- '<|python_tag|>' }}{%- endif %}"
                   "{{- message['content'] }}{%- endfor %}")
HERMES_LIKE = ("{%- if tools %}For each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>{%- endif %}")


def _read(calls):
    return [(c.name, c.arguments, c.error) for c in calls]


def test_llama3_json_reads_one_call_several_calls_and_the_python_tag():
    one = '{"name": "calculator", "parameters": {"expression": "37 + 48"}}'
    assert _read(llama3_json(one)) == [("calculator", {"expression": "37 + 48"}, None)]
    assert _read(llama3_json("<|python_tag|>" + one + "\n")) == [("calculator", {"expression": "37 + 48"}, None)]
    # two calls separated by ';' ("arguments", and arguments as a JSON string, are read as well)
    two = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": "{\\"y\\": 2}"};'
    assert _read(llama3_json(two)) == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]


def test_llama3_json_marks_unreadable_calls_malformed():
    # the closing brace is missing: unreadable JSON that names a "name" is a call gone wrong
    assert _read(llama3_json('{"name": "calculator", "parameters": {"expression": "1+2"}')) == [
        ("", None, "malformed")]
    # after <|python_tag|> anything is a call: Llama's built-in code form is not a JSON call
    assert _read(llama3_json('<|python_tag|>brave_search.call(query="x")')) == [("", None, "malformed")]
    # a call then prose, or then a non-call object: the call runs, the rest is one malformed call
    assert _read(llama3_json('{"name": "a", "parameters": {}} and then I add them')) == [
        ("a", {}, None), ("", None, "malformed")]
    assert _read(llama3_json('{"name": "a", "parameters": {}}; {"answer": 1}')) == [
        ("a", {}, None), ("", None, "malformed")]
    # parameters as a string that is not JSON: the name is kept, the call is malformed
    assert _read(llama3_json('{"name": "a", "parameters": "x=1"}')) == [("a", None, "malformed")]


@pytest.mark.parametrize("answer", [
    "The answer is 85.",
    '{"answer": 85}',  # a JSON answer: no name
    '{"name": "Ada Lovelace", "born": 1815}',  # a name but no parameters/arguments: data, not a call
    "{x | x > 0} is the set of positive numbers.",  # prose that opens with a brace
    'I would call {"name": "calculator", "parameters": {}} but I know it: 85.',  # a call must open the turn
    "",
])
def test_llama3_json_takes_answers_as_answers(answer):
    assert llama3_json(answer) == []


def test_auto_picks_the_parser_the_template_mentions():
    assert detect_parser(LLAMA3_LIKE) == "llama3_json"  # the {"name": ..., "parameters": ...} instruction
    assert detect_parser(PYTHON_TAG_ONLY) == "llama3_json"
    assert detect_parser(HERMES_LIKE) == "hermes"
    # <tool_call> wins over a template that also shows "name" ... "parameters" (e.g. in a schema example)
    assert detect_parser(HERMES_LIKE + '{"name": "f", "parameters": {}}') == "hermes"
    from rlft.models.tiny import CHATML_TEMPLATE

    assert detect_parser(CHATML_TEMPLATE) == "hermes" and detect_parser(None) == "hermes"  # no tool syntax
    assert pick_parser("auto", LLAMA3_LIKE) is llama3_json and pick_parser("auto", HERMES_LIKE) is hermes
    assert pick_parser("hermes", LLAMA3_LIKE) is hermes  # a name given is taken as given
    with pytest.raises(ConfigError, match=r"agent.parser: unknown parser 'llama3'; known: auto, hermes, llama3_json"):
        pick_parser("llama3", None)


def test_the_prompt_block_teaches_the_chosen_parsers_syntax(qwen_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_path)  # ChatML without tool support: rlft's block
    schemas = [t.schema for t in load_tools(["calculator"])]
    for name, parser in PARSERS.items():
        text = ObservationEncoder(tok, schemas, parser.syntax).render([{"role": "user", "content": "Hi"}], True)
        assert f"To call a tool, {parser.syntax} and end your turn" in text, name
    assert '"parameters"' in llama3_json.syntax and "<tool_call>" not in llama3_json.syntax
    assert "<tool_call>" in hermes.syntax


def test_agent_tools_prompt_replaces_the_block_in_rollouts_and_sft_alike(qwen_path, tmp_path):
    """agent.tools_prompt: {signatures}, {schemas} and {syntax} filled in, other braces kept; the
    rollout's prompt and the SFT row's prompt are the same ids (both read it from `agent`)."""
    from transformers import AutoTokenizer

    from conftest import make_config
    from rlft.config import load_config
    from rlft.data.sft_examples import row_messages
    from rlft.data.tool_transcripts import tool_transcripts
    from rlft.rollout.agent import turn_driver
    from rlft.rollout.agent.turns import TOOLS_BLOCK, signature, tools_block

    [schema] = [t.schema for t in load_tools(["calculator"])]
    assert signature(schema) == "calculator(expression: string): Evaluate an arithmetic expression."
    optional = {"function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}, "b": {}},
                                                         "required": ["a"]}}}
    assert signature(optional) == "f(a: integer, b?: any)"  # no description: no trailing colon
    block = 'Tools:\n{signatures}\nTo call one, {syntax}. e.g. {"name": "calculator"}'
    assert tools_block(block, [schema], "SYN") == ("Tools:\ncalculator(expression: string): Evaluate an arithmetic "
                                                   'expression.\nTo call one, SYN. e.g. {"name": "calculator"}')
    assert tools_block(TOOLS_BLOCK, [schema], "SYN") == TOOLS_BLOCK.format(schemas=json.dumps(schema), syntax="SYN")

    tok = AutoTokenizer.from_pretrained(qwen_path)
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 37 + 48?"}]
    row = {"messages": [*question, {"role": "assistant", "content": "The answer is 85."}]}
    cfg = load_config(make_config(qwen_path, tmp_path / "x.jsonl", tmp_path / "run",
                                  agent={"tools": ["calculator"], "tools_prompt": block}))
    rollout_ids = turn_driver(cfg.agent, ScriptedEngine(tok, []), tok).encoder.prompt_ids(question)
    sft = tool_transcripts(cfg.agent, tok).encode(row_messages(row))
    assert sft.input_ids[:len(rollout_ids)] == rollout_ids and sft.target_mask[len(rollout_ids) - 1] == 0
    text = tok.decode(rollout_ids)
    assert "Be brief.\n\nTools:\ncalculator(expression: string)" in text and "<tools>" not in text
    assert f"To call one, {hermes.syntax}." in text


def test_an_episode_on_a_llama3_like_template_calls_the_tool_and_reads_the_result(qwen_path):
    """auto -> llama3_json from the template; the JSON turn runs the calculator, its result comes
    back in the template's `ipython` turn, the model's next turn answers; malformed JSON gets an
    error observation that teaches the llama3 syntax."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_path)
    tok.chat_template = LLAMA3_LIKE
    prompt = [{"role": "user", "content": "What is 37 + 48?"}]
    script = ['{"name": "calculator", "parameters": {"expression": "37 + 48"}}', '{"name": "calculator"',
              "The answer is 85."]
    engine = ScriptedEngine(tok, script)
    driver = TurnDriver(engine, tok, load_tools(["calculator"]), pick_parser("auto", tok.chat_template),
                        AgentLimits(max_total_tokens=2000))
    assert driver.encoder.native_tools  # the template shows the schemas itself
    [ep] = driver.run([prompt], SamplingParams(n=1, max_new_tokens=200))
    results = [m["content"] for m in ep.episode.messages if m["role"] == "tool"]
    assert results[0] == "85" and results[1].startswith("Error: the tool call could not be read")
    assert llama3_json.syntax in results[1]
    assert ep.episode.errors == {"malformed": 1} and ep.episode.turns == 3 and ep.text == "The answer is 85."
    turn2_context = tok.decode(engine.contexts[1][0])
    assert turn2_context.endswith("<|start_header_id|>ipython<|end_header_id|>\n\n85<|im_end|>"
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("on_tool_error", ["observe", "end"])
def test_a_failed_call_is_observed_or_ends_the_episode_by_setting(qwen_path, on_tool_error):
    """observe: the model reads the error and answers. end: the turn with the failed call is the
    episode's last (finish 'stop', nothing inserted, the next turn never sampled), and the
    failure is counted by kind all the same (the good call of that turn ran too)."""
    from transformers import AutoTokenizer

    policy = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(qwen_path))
    calls = call_text("nope", {}) + call_text("calculator", {"expression": "6*7"})
    driver, engine = driver_for(policy, [calls, "It is 42."], on_tool_error=on_tool_error)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    turn1 = engine.sampled[0][0]
    assert ep.episode.errors == {"unknown_tool": 1} and ep.episode.tool_calls == 2
    assert ep.finish_reason == "stop"
    metrics = episode_metrics([ep])
    assert metrics["agent/errors/unknown_tool"] == 1.0 and metrics["agent/tool_error_rate"] == 0.5
    if on_tool_error == "observe":
        assert ep.episode.turns == 2 and ep.text == "It is 42." and not ep.episode.ended_on_error
        assert [m["content"][:6] for m in ep.episode.messages if m["role"] == "tool"] == ["Error:", "42"]
        assert metrics["agent/ended_on_error"] == 0.0
    else:
        assert len(engine.contexts) == 1 and ep.episode.turns == 1 and ep.episode.ended_on_error
        assert ep.completion_ids == turn1 and ep.loss_mask == [1] * len(turn1)  # no observation inserted
        assert ep.episode.messages[-1]["role"] == "assistant" and ep.episode.tool_tokens == 0
        assert metrics["agent/ended_on_error"] == 1.0
    # the setting reaches the driver from config; anything else is refused, naming the field
    from rlft.config import load_config
    from rlft.rollout.agent import turn_driver

    base = {"method": "grpo", "output_dir": "/tmp/unused", "model": {"path": "x"}, "data": {"train": "x"},
            "rewards": [{"fn": "math"}]}
    cfg = load_config({**base, "agent": {"tools": ["calculator"], "on_tool_error": on_tool_error}})
    assert turn_driver(cfg.agent, engine, policy.tokenizer).limits.on_tool_error == on_tool_error
    with pytest.raises(ConfigError, match="agent.on_tool_error: input should be 'observe' or 'end'"):
        load_config({**base, "agent": {"tools": ["calculator"], "on_tool_error": "stop"}})
