"""SFT on tool-use transcripts: the rows an SFT run trains on are, token for token, the episodes RL
samples for the same conversation (a template with native tool support and one without); bad
tool rows are named; a short run on the tiny model learns from them."""

from __future__ import annotations

import json

import pytest

from conftest import ScriptedEngine, make_config, write_jsonl
from rlft.config import ModelConfig
from rlft.data.readers import Row
from rlft.data.sft_examples import make_sft_encoder, row_messages
from rlft.data.tool_transcripts import TranscriptEncoder
from rlft.data.validate import check_rows
from rlft.errors import DataError
from rlft.models.loading import load_tokenizer
from rlft.models.template import end_of_turn_ids, render
from rlft.rollout.contract import SamplingParams
from rlft.rollout.agent.tool_calls import ParsedCall, hermes, llama3_json, pick_parser, pick_writer, write_hermes, \
    write_llama3_json
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver

# SmolLM2-Instruct's template: no tool support; `tool` messages become plain turns, `tool_calls`
# are dropped, and a default system prompt appears when the conversation has none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# A Qwen2.5-like template (written for this test): tools in the system turn, calls rendered from
# `tool_calls` in the Hermes syntax, consecutive tool results grouped into one user turn.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Turn 1 makes two calls (one with OpenAI's JSON-string arguments), turn 2 one (content null, as
# OpenAI writes it), turn 3 answers. The results are what the calculator returns.
TRANSCRIPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is (37 + 48) * 2?"},
    {"role": "assistant", "content": "Let me compute.",
     "tool_calls": [call("calculator", '{"expression": "37 + 48"}'), call("calculator", {"expression": "85 * 2"})]},
    {"role": "tool", "content": "85"},
    {"role": "tool", "name": "calculator", "content": "170", "tool_call_id": "b"},
    {"role": "assistant", "content": None, "tool_calls": [call("calculator", {"expression": "170 / 2"})]},
    {"role": "tool", "content": "85"},
    {"role": "assistant", "content": "The answer is 170."},
]
# What a Hermes/Qwen model samples for those turns, written by hand: the parser's syntax in
# Qwen2.5's layout (content, then each call on lines of its own).
SAMPLED = [
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 + 48"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "85 * 2"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "170 / 2"}}\n</tool_call>',
    "The answer is 170.",
]
# The same conversation for a Llama 3 model (llama3_json): a turn that calls holds only the calls
TRANSCRIPT_LLAMA = [{**m, "content": ""} if m.get("tool_calls") else m for m in TRANSCRIPT]
SAMPLED_LLAMA = [
    '{"name": "calculator", "parameters": {"expression": "37 + 48"}}; '
    '{"name": "calculator", "parameters": {"expression": "85 * 2"}}',
    '{"name": "calculator", "parameters": {"expression": "170 / 2"}}',
    "The answer is 170.",
]
# What each template puts between a turn's <|im_end|> and the next turn (the observations)
OBSERVED = {
    "smollm2": ["\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>tool\n170<|im_end|>\n<|im_start|>assistant\n",
                "\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>assistant\n"],
    "qwen_like": ["\n<|im_start|>user\n<tool_response>\n85\n</tool_response>\n<tool_response>\n170\n</tool_response>"
                  "<|im_end|>\n<|im_start|>assistant\n",
                  "\n<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>\n<|im_start|>assistant\n"],
}


@pytest.fixture(params=[("smollm2", "hermes"), ("qwen_like", "hermes"), ("smollm2", "llama3_json")],
                ids=["smollm2-hermes", "qwen_like-hermes", "smollm2-llama3_json"])
def templated(request, qwen_path):
    template, parser = request.param
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    tok.chat_template = SMOLLM2_TEMPLATE if template == "smollm2" else QWEN_LIKE_TEMPLATE
    return template, parser, tok


def transcripts(tok, max_tool_output_tokens: int = 256, parser: str = "hermes") -> TranscriptEncoder:
    return TranscriptEncoder(tok, load_tools(["calculator"]), pick_parser(parser, None), pick_writer(parser, None),
                             max_tool_output_tokens)


def spans(tok, ids: list[int], mask: list[int]) -> list[tuple[int, str]]:
    """Runs of equal mask value, decoded: [(mask, text), ...]."""
    out: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return [(m, tok.decode(run)) for m, run in out]


def test_an_sft_row_is_the_episode_rl_samples_for_the_same_conversation(templated):
    """A scripted engine samples SAMPLED through a TurnDriver with the real calculator; the SFT row
    of TRANSCRIPT is the same ids, its target mask the episode's loss mask over the completion."""
    name, parser, tok = templated
    transcript, sampled = (TRANSCRIPT, SAMPLED) if parser == "hermes" else (TRANSCRIPT_LLAMA, SAMPLED_LLAMA)
    engine = ScriptedEngine(tok, sampled)
    driver = TurnDriver(engine, tok, load_tools(["calculator"]), pick_parser(parser, None),
                        AgentLimits(max_total_tokens=4000))
    [ep] = driver.run([transcript[:2]], SamplingParams(n=1, max_new_tokens=500))
    assert ep.episode.tool_calls == 3 and ep.episode.errors == {} and ep.episode.turns == 3

    sft = transcripts(tok, parser=parser).encode(row_messages({"messages": transcript}))
    assert sft.input_ids == ep.prompt_ids + ep.completion_ids
    assert sft.target_mask == [0] * len(ep.prompt_ids) + ep.loss_mask
    # by hand: targets are the turns as sampled with their <|im_end|>; between them, the results
    pieces = spans(tok, sft.input_ids, sft.target_mask)
    assert [m for m, _ in pieces] == [0, 1, 0, 1, 0, 1]
    assert [t for m, t in pieces if m] == [s + "<|im_end|>" for s in sampled]
    assert [t for m, t in pieces[2::2]] == OBSERVED[name]
    prompt = pieces[0][1]
    if name == "smollm2":  # no tool support: the schemas come in rlft's system block (the default one is gone)
        assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools.") and "SmolLM" not in prompt
        assert pick_parser(parser, None).syntax in prompt  # it teaches the parser's own syntax
    else:  # the template's own tools= rendering
        assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n") and "You can call" not in prompt
        # and its own rendering of the (normalised) tool_calls is the text the writer produced
        with_calls = render(tok, row_messages({"messages": TRANSCRIPT})[:3])
        assert with_calls == render(tok, [*TRANSCRIPT[:2], {"role": "assistant", "content": SAMPLED[0]}])
    # a generation eval continues from the last turn's context, as trained
    assert sft.last_text == "The answer is 170." and tok.decode(sft.input_ids[sft.last_turn_start:]) == \
        "The answer is 170.<|im_end|>"

    # RL's own record of the episode (calls in the text and in tool_calls) is SFT data for the same ids
    again = transcripts(tok, parser=parser).encode(row_messages({"messages": ep.episode.messages}))
    assert (again.input_ids, again.target_mask) == (sft.input_ids, sft.target_mask)


def test_each_writer_is_read_back_by_its_parser():
    calls = [ParsedCall("calculator", {"expression": "2 * 21"}), ParsedCall("lookup", {"city": "Zürich", "n": 2})]
    text = write_hermes("Checking.", calls)
    assert text == ('Checking.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 21"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Zürich", "n": 2}}\n'
                    '</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in hermes(text)] == [(c.name, c.arguments, None) for c in calls]
    assert write_hermes("", calls[:1]).startswith("<tool_call>\n")  # no content: the call opens the turn
    text = write_llama3_json("", calls)
    assert text == ('{"name": "calculator", "parameters": {"expression": "2 * 21"}}; '
                    '{"name": "lookup", "parameters": {"city": "Zürich", "n": 2}}')
    assert [(c.name, c.arguments, c.error) for c in llama3_json(text)] == [(c.name, c.arguments, None) for c in calls]
    assert write_llama3_json("The answer is 42.", []) == "The answer is 42."
    with pytest.raises(ValueError, match="holds only the calls"):  # the parser would read this turn as an answer
        write_llama3_json("Checking.", calls)


def test_tool_results_are_cut_as_rollouts_cut_them(qwen_path):
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    long = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [call(
        "calculator", {"expression": "1"})]}, {"role": "tool", "content": "word " * 100},
        {"role": "assistant", "content": "Done."}]
    enc = transcripts(tok, max_tool_output_tokens=5).encode(row_messages({"messages": long}))
    pieces = spans(tok, enc.input_ids, enc.target_mask)
    assert "more tokens]<|im_end|>" in pieces[2][1] and pieces[2][1].count("word") < 10


BAD_ROWS = [  # (row, reason expected in the report)
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": {"function": {"name": "calculator"}}}]},
     "malformed 'tool_calls'"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "tool call without a function name"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [call("calculator", [1, 2])]}]},
     "tool call arguments are not a JSON object"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [call("calculator", "{expression: 1}")]}]},
     "tool call arguments are not a JSON object"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "85"},
                   {"role": "assistant", "content": "85"}]}, "tool message with no preceding call"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me see."},
                   {"role": "tool", "content": "85"}, {"role": "assistant", "content": "85"}]},
     "tool message with no preceding call"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [call("calculator", {"expression": "1"})] * 2},
                   {"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}]},
     "tool results do not match the calls"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [call("search", {"q": "x"})]},
                   {"role": "tool", "content": "x"}, {"role": "assistant", "content": "x"}]},
     "call to a tool not in agent.tools"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [call("calculator", {"expression": "1"})]},
                   {"role": "tool", "name": "search", "content": "1"}, {"role": "assistant", "content": "1"}]},
     "tool result named after another tool"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "<tool_call>{oops}</tool_call>"}]},
     "unreadable tool call in an assistant message"),
]


def test_malformed_tool_rows_are_named_in_one_report(qwen_path, tmp_path):
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    good = {"messages": TRANSCRIPT}
    rows = [Row(f"tools.jsonl:{i + 1}", r) for i, r in enumerate([good] + [r for r, _ in BAD_ROWS] + [good])]
    encode = make_sft_encoder(tok, end_of_turn_ids(tok), 4000, transcripts=transcripts(tok))
    with pytest.raises(DataError) as info:
        check_rows(rows, encode, "tools.jsonl", "SFT")
    message = str(info.value)
    assert f"tools.jsonl: {len(BAD_ROWS)} of {len(rows)} SFT rows are invalid" in message
    for line, (_, reason) in enumerate(BAD_ROWS, start=2):
        assert f"x {reason}" in message and f"tools.jsonl:{line}:" in message, (line, reason, message)
    assert "messages[1].tool_calls[0].function.arguments must be an object or a string holding one, got list" \
        in message and "messages[1] calls 'search'; agent.tools has ['calculator']" in message
    # without an agent section the calls cannot be rendered as rollouts parse them: refused, with the fix
    plain = make_sft_encoder(tok, end_of_turn_ids(tok), 4000)
    with pytest.raises(DataError, match=r"tools.jsonl:1: set agent.tools"):
        check_rows(rows[:1], plain, "tools.jsonl", "SFT")
    assert len(check_rows(rows[:1], encode, "tools.jsonl", "SFT")) == 1
    # Llama 3's syntax has no text beside a call: TRANSCRIPT's first turn cannot be written in it
    llama = make_sft_encoder(tok, end_of_turn_ids(tok), 4000, transcripts=transcripts(tok, parser="llama3_json"))
    with pytest.raises(DataError, match=r"a turn the call syntax cannot express\n.*tools.jsonl:1: messages\[2\]: "
                                        r"in the llama3_json syntax"):
        check_rows(rows[:1], llama, "tools.jsonl", "SFT")


def tool_rows(n: int) -> list[dict]:
    """'What is a + b?' -> a calculator call -> its result -> 'The answer is N.'"""
    rows = []
    for i in range(n):
        a, b = 10 + 7 * i % 80, 3 + 5 * i % 40
        rows.append({"messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call("calculator", {"expression": f"{a} + {b}"})]},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."}], "answer": str(a + b)})
    return rows


def test_sft_on_tool_transcripts_trains_on_the_calls_and_never_on_the_results(qwen_path, tmp_path):
    from rlft import api
    from rlft.config import load_config
    from rlft.models.loading import load_policy
    from rlft.training.offline.loop import make_objective

    train = write_jsonl(tmp_path / "tools.jsonl", tool_rows(24))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", tool_rows(28)[24:])
    config = make_config(qwen_path, train, tmp_path / "run", data={"max_length": 1024, "eval": str(held_out)},
                         training={"learning_rate": 5e-3, "batch_size": 8, "epochs": 3},
                         eval={"max_examples": 4, "max_new_tokens": 8}, agent={"tools": ["calculator"]})
    cfg = load_config(config)
    policy = load_policy(cfg.model, cfg.lora)
    rows, _, _ = make_objective(cfg).prepare(policy)
    example = rows.examples[0]
    pieces = spans(policy.tokenizer, example.input_ids, example.target_mask)
    targets = [t for m, t in pieces if m]
    assert targets == ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "10 + 3"}}\n</tool_call>'
                       "<|im_end|>", "The answer is 13.<|im_end|>"]
    assert pieces[2] == (0, "\n<|im_start|>tool\n13<|im_end|>\n<|im_start|>assistant\n")  # the result: context only
    assert "<tools>" in pieces[0][1]  # the tools are presented as in rollouts

    summary = api.train(config)
    assert summary["status"] == "completed" and summary["step"] == 9  # 24 rows / 8 per step, 3 epochs
    assert summary["eval/num_prompts"] == 4 and summary["eval/loss"] < 4.0  # generations from the last turn's context
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    # a random model over 512 tokens starts near ln(512) = 6.24 nats per target; measured here: 6.26
    # falling to 3.6-3.7 over the last steps, held-out 3.57 (the call syntax is learnt, the numbers not yet)
    assert losses[0] > 5.5 and sum(losses[-3:]) / 3 < 4.0


def test_the_sft_term_of_rl_with_tools_is_encoded_as_its_episodes(qwen_path, tmp_path):
    """algorithm.sft_mix rows in a run with an agent section: tools presented, calls written, as SFT does."""
    from rlft.config import load_config
    from rlft.training.online.sft_mix import build_sft_mix

    rows = write_jsonl(tmp_path / "sft.jsonl", tool_rows(2))
    cfg = load_config({"method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path)},
                       "data": {"train": str(rows), "max_prompt_length": 1000}, "rewards": [{"fn": "math"}],
                       "agent": {"tools": ["calculator"]}, "algorithm": {"sft_mix": str(rows)}})
    tok = load_tokenizer(cfg.model)
    mix = build_sft_mix(cfg, tok)
    expected = transcripts(tok).encode(row_messages(tool_rows(2)[1]))
    assert (mix.examples[1].input_ids, mix.examples[1].target_mask) == (expected.input_ids, expected.target_mask)
    assert "<tools>" in tok.decode(mix.examples[1].input_ids)


COUNTDOWN = '''
class Countdown:
    """Says 'Go on.' until a turn says 1."""

    def __init__(self, seed):
        pass

    def reset(self, **row):
        return "Count down from 3."

    def step(self, text):
        return ("Done.", 1.0, True) if "1" in text else ("Go on.", 0.0, False)
'''


def test_an_episode_with_an_environment_and_a_tool_is_sft_data_for_the_same_ids(qwen_path, tmp_path):
    """Turn 1 calls the calculator (a tool result follows), turns 2-4 are the environment's actions
    (its observations are user messages): RL's record of the episode, as an SFT row, is its ids."""
    from rlft.rollout.agent.environments import load_environment

    (tmp_path / "countdown.py").write_text(COUNTDOWN)
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    engine = ScriptedEngine(tok, [SAMPLED[1], "3", "2", "1"])
    driver = TurnDriver(engine, tok, load_tools(["calculator"]), hermes, AgentLimits(max_total_tokens=4000),
                        environment=load_environment(f"{tmp_path / 'countdown.py'}:Countdown", {}, 0))
    [ep] = driver.run([TRANSCRIPT[:2]], SamplingParams(n=1, max_new_tokens=500))
    roles = [m["role"] for m in ep.episode.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "user", "assistant"]
    assert ep.episode.env_done and ep.episode.messages[5] == {"role": "user", "content": "Go on."}
    sft = transcripts(tok).encode(row_messages({"messages": ep.episode.messages}))
    assert sft.input_ids == ep.prompt_ids + ep.completion_ids
    assert sft.target_mask == [0] * len(ep.prompt_ids) + ep.loss_mask
    assert [t for m, t in spans(tok, sft.input_ids, sft.target_mask) if m] == \
        [SAMPLED[1] + "<|im_end|>", "3<|im_end|>", "2<|im_end|>", "1<|im_end|>"]
