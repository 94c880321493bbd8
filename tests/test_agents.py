"""Multi-turn rollouts with tools: token-exact episodes, the loss mask through the update, tool
failures as observations, limits, and a short GRPO run with the calculator.

A tiny random model almost never writes a valid tool call, so the unit tests drive episodes with a
scripted engine: it "samples" fixed token ids per turn (with made-up log-probs) and records what it
was asked to continue from."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import torch

from conftest import ScriptedEngine, call_text
from rlft.errors import ConfigError
from rlft.models.template import encode_text
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.agent.tool_calls import hermes, pick_parser
from rlft.rollout.agent.tools import calculator, load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver, episode_metrics
from rlft.training.online import update as rl_update

PROMPT = [{"role": "user", "content": "What is 37 + 48?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("agents") / "model", seed=0)
    return path, load_policy(ModelConfig(path=str(path), device="cpu"), LoraConfig())


def driver_for(policy, script, tools=("calculator",), end_turn=True, **limits):
    engine = ScriptedEngine(policy.tokenizer, script, end_turn)
    loaded = load_tools(list(tools)) if all(isinstance(t, str) for t in tools) else list(tools)
    return TurnDriver(engine, policy.tokenizer, loaded, pick_parser("auto", None), AgentLimits(**limits)), engine


def test_the_loss_sees_exactly_the_sampled_ids_and_the_observations_between_them(tiny):
    """Token by token: batch row = prompt | turn-1 ids as sampled | observation (encoded once) |
    turn-2 ids as sampled; the loss mask marks exactly the sampled ids, and the engine was asked to
    continue exactly from what the loss sees."""
    _, policy = tiny
    driver, engine = driver_for(policy, [call_text("calculator", {"expression": "37 + 48"}), "The answer is 85."])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    turn1, turn2 = engine.sampled[0][0], engine.sampled[1][0]
    obs = driver.encoder.observation_ids(PROMPT, [{"role": "tool", "name": "calculator", "content": "85"}], turn1[-1])
    assert policy.tokenizer.decode(obs) == "\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>assistant\n"
    assert engine.contexts[1] == [ep.prompt_ids + turn1 + obs]  # turn 2 continued the very same tokens
    assert engine.streams == [None, ["0/0/2"]]  # turn 2 of prompt 0's sample 0, in the request turn 1 made
    assert ep.completion_ids == turn1 + obs + turn2
    assert ep.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert ep.episode.turns == 2 and ep.episode.tool_calls == 1 and ep.episode.errors == {}
    assert ep.text == "The answer is 85." and ep.finish_reason == "stop"
    assert ep.episode.messages[-2] == {"role": "tool", "name": "calculator", "content": "85"}
    assert ep.episode.retokenize_drift == 0  # canonical text: re-rendering gives the same tokens

    batch = RolloutBatch.from_completions([ep], [0], policy.tokenizer.pad_token_id, torch.device("cpu"))
    row = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert row == ep.prompt_ids + turn1 + obs + turn2
    sampled_cols = batch.completion_mask[0].nonzero().squeeze(-1).tolist()
    completion = batch.input_ids[0, -batch.completion_len:]
    assert completion[sampled_cols].tolist() == turn1 + turn2
    # sampling log-probs: each turn's own, in place; 0 on the observation
    expected_lp = [-(1.0 + k) for k in range(len(turn1))] + [0.0] * len(obs) + [-(1.0 + k) for k in range(len(turn2))]
    assert batch.sampling_logprobs[0].tolist() == expected_lp


def test_samples_show_each_segment_of_an_episode_with_its_role_and_whether_it_was_trained(tiny):
    """samples.jsonl's `segments`: the episode's ids cut where the loss mask changes, decoded with
    the template's markers: turn 1 (trained), the tool result as inserted (untrained), turn 2."""
    from rlft.rollout.contract import trained_segments

    _, policy = tiny
    tok = policy.tokenizer
    driver, engine = driver_for(policy, [call_text("calculator", {"expression": "37 + 48"}), "The answer is 85."])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    segments = trained_segments(ep, tok.decode, ep.episode.messages[len(PROMPT):])
    assert segments == [
        {"role": "assistant", "text": call_text("calculator", {"expression": "37 + 48"}) + "<|im_end|>", "trained": True},
        {"role": "tool", "text": "\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>assistant\n", "trained": False},
        {"role": "assistant", "text": "The answer is 85.<|im_end|>", "trained": True}]
    assert "".join(s["text"] for s in segments) == tok.decode(ep.completion_ids)
    # token by token: each segment's ids carry its trained flag in the loss mask
    runs = [(engine.sampled[0][0], True), (ep.completion_ids[len(engine.sampled[0][0]):-len(engine.sampled[1][0])],
                                           False), (engine.sampled[1][0], True)]
    assert ep.loss_mask == [int(trained) for ids, trained in runs for _ in ids]
    assert [tok.decode(ids) for ids, _ in runs] == [s["text"] for s in segments]
    # a single-turn completion is one trained assistant segment
    single = Completion([1], [10, 11], "", [-1.0, -1.0], "stop", 0)
    assert trained_segments(single, tok.decode, []) == [{"role": "assistant", "text": tok.decode([10, 11]),
                                                         "trained": True}]


def test_a_call_cut_off_by_a_stop_string_is_still_read_from_the_sampled_ids(tiny):
    _, policy = tiny
    driver, engine = driver_for(policy, [call_text("calculator", {"expression": "1+1"}), "2"])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200, stop=("</tool_call>",)))
    assert ep.episode.tool_calls == 1 and ep.episode.errors == {} and ep.episode.messages[-2]["content"] == "2"


def test_the_re_render_check_counts_tokens_a_re_encoding_would_change(tiny):
    """A turn sampled as one character per token is text the tokenizer would encode with merges:
    the trained ids are kept as sampled, and the drift names how many trained tokens a re-encoding
    would have replaced (everything from that turn on)."""
    _, policy = tiny
    tok = policy.tokenizer
    chars = [i for ch in "The answer is 85." for i in encode_text(tok, ch)]
    canonical = encode_text(tok, "The answer is 85.")
    first = next(k for k, (a, b) in enumerate(zip(chars, canonical)) if a != b)  # where the splits part
    driver, engine = driver_for(policy, [call_text("calculator", {"expression": "37 + 48"}), chars])
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    assert ep.completion_ids[-len(chars) - 1:-1] == chars  # trained as sampled, not re-encoded
    assert ep.episode.retokenize_drift == len(chars) - first + 1  # the rest of the turn and its end-of-turn
    assert episode_metrics([ep])["agent/retokenize_drift_frac"] == 1.0


def test_reward_sits_on_the_last_policy_token_of_a_mask_with_holes():
    from rlft.algorithms import ADVANTAGE_ESTIMATORS
    from rlft.training.online.update import token_rewards

    # row 0: sampled, sampled, tool, tool, sampled, then padding -> the reward goes to column 4;
    # `mask.sum() - 1` would have put it on column 2, a sampled token before the tool output.
    # row 1: single-turn, 3 tokens -> column 2.
    comps = [Completion([5], [10, 11, 12, 13, 14], "", [-1.0] * 5, "stop", 0, loss_mask=[1, 1, 0, 0, 1]),
             Completion([5], [10, 11, 12], "", [-1.0] * 3, "stop", 0)]
    batch = RolloutBatch.from_completions(comps, [0, 0], 0, torch.device("cpu"))
    rewards = token_rewards([1.0, 0.0], batch, None)
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0]]
    # group_norm: scores 1 and 0 -> +-0.7071 on each row's policy tokens, 0 on tool tokens and padding
    adv, _ = ADVANTAGE_ESTIMATORS["group_norm"](rewards, batch.completion_mask, batch.group_ids, torch.ones(2).bool())
    assert (adv[0, [2, 3]] == 0).all() and (adv[1, 3:] == 0).all()
    torch.testing.assert_close(adv[0, [0, 1, 4]], torch.full((3,), 0.5 ** 0.5), rtol=1e-4, atol=0)


class _Recorder:
    """Stands in for the training session: keeps each update's loss and gradients, never steps."""

    def __init__(self, policy):
        self.policy, self.grads, self.losses = policy, [], []

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self, loss_value):
        self.losses.append(loss_value)
        self.grads.append({n: p.grad.clone() for n, p in self.policy.model.named_parameters() if p.grad is not None})
        self.policy.model.zero_grad(set_to_none=True)
        return True, 0.0


def _settings(**over):
    from rlft.config import load_config
    from rlft.training.online.update import UpdateSettings

    cfg = load_config({"method": "grpo", "output_dir": "/tmp/unused", "model": {"path": "x"},
                       "data": {"train": "x"}, "rewards": [{"fn": "math"}],
                       "training": {"precision": "fp32"}, "algorithm": over})
    return UpdateSettings.from_config(cfg)


def test_tool_tokens_get_exactly_zero_gradient(tiny, monkeypatch):
    """Policy loss + KL in the loss + entropy bonus: d loss / d log-prob and d loss / d entropy are
    exactly 0 at every tool-token position, and not 0 at sampled ones."""
    from rlft.training.online import update as rl_update

    _, policy = tiny
    driver, _ = driver_for(policy, [call_text("calculator", {"expression": "2*21"}), "It is 42."])
    eps = driver.run([PROMPT, [{"role": "user", "content": "Twice 21?"}]], SamplingParams(n=2, max_new_tokens=200))
    batch = RolloutBatch.from_completions(eps, [0, 0, 1, 1], policy.tokenizer.pad_token_id, policy.device)
    tool_cols = ~batch.completion_mask & batch.attention_mask[:, -batch.completion_len:].bool()  # [N, T]
    assert tool_cols.any()
    seen = []
    real = rl_update.completion_logprobs

    def keep_grads(*args, **kwargs):
        out = real(*args, **kwargs)
        for t in out[:2]:
            t.retain_grad()
        seen.append(out)
        return out

    monkeypatch.setattr(rl_update, "completion_logprobs", keep_grads)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch.completion_mask  # [N, T]
    ref = batch.sampling_logprobs - 0.3  # a reference that differs: the KL term has a gradient
    recorder = _Recorder(policy)
    rl_update.policy_update(recorder, batch, advantages, ref, 0.1, _settings(entropy_coef=0.01), torch.Generator())
    [(logprobs, entropy)] = seen
    for grad in (logprobs.grad, entropy.grad):
        assert torch.equal(grad[tool_cols], torch.zeros_like(grad[tool_cols]))
        assert (grad[batch.completion_mask] != 0).all()


def test_a_one_turn_episode_updates_exactly_like_a_single_turn_completion(tiny):
    """The real HF engine: an episode that ends after one turn (no call) is the engine's own
    completion, and the update from it equals the single-turn update: same loss, same gradients."""
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    _, policy = tiny
    params = SamplingParams(n=4, max_new_tokens=10)
    tools = load_tools(["calculator"])

    def engine():
        return HFEngine(policy.model, policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer),
                        policy.device, seed=3)

    driver = TurnDriver(engine(), policy.tokenizer, tools, hermes, AgentLimits())
    prompts = [PROMPT, [{"role": "user", "content": "Count to 3."}]]
    episodes = driver.run(prompts, params)
    assert all(e.episode.turns == 1 and e.episode.tool_calls == 0 for e in episodes)
    single = engine().generate([driver.encoder.prompt_ids(m) for m in prompts], params)
    for e, s in zip(episodes, single):
        assert (e.prompt_ids, e.completion_ids, e.logprobs, e.finish_reason) == \
            (s.prompt_ids, s.completion_ids, s.logprobs, s.finish_reason)
    updates = []
    for comps in (episodes, single):
        batch = RolloutBatch.from_completions(comps, [c.prompt_index for c in comps], 0, policy.device)
        adv = torch.tensor([len(c.completion_ids) % 3 - 1.0 for c in comps])[:, None] * batch.completion_mask
        recorder = _Recorder(policy)
        rl_update.policy_update(recorder, batch, adv, None, 0.0, _settings(entropy_coef=0.01), torch.Generator())
        updates.append(recorder)
    assert updates[0].losses == updates[1].losses and updates[0].losses[0] != 0
    g0, g1 = updates[0].grads[0], updates[1].grads[0]
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def test_parser_reads_hermes_calls_and_marks_unreadable_ones():
    calls = hermes('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
                   '</tool_call><tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                   '<tool_call>{"name": oops}</tool_call><tool_call>{"name": "g"')
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("f", {"x": 1}, None), ("", None, "malformed"),
        ("", None, "malformed")]  # the last one is never closed
    assert hermes("no call here") == []


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("(37 + 48) * 2") == "170" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "open('x')", "2 ** 10000", "[1, 2]", "a + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_every_failure_kind_is_an_error_observation_and_counted_and_a_hang_is_bounded(tiny):
    _, policy = tiny
    release = threading.Event()

    def boom(x: int) -> str:
        """Always fails.

        Args:
            x: Anything.
        """
        raise RuntimeError("kaput")

    def sleepy(seconds: float) -> str:
        """Hangs.

        Args:
            seconds: How long.
        """
        release.wait(seconds)
        return "late"

    def silent(x: int) -> str:
        """Returns no text.

        Args:
            x: Anything.
        """
        return None

    calls = "".join([call_text("calculator", {"expr": "1"}),  # bad arguments
                     call_text("nope", {}),  # unknown tool
                     "<tool_call>{not json}</tool_call>",  # malformed
                     call_text("boom", {"x": 1}),  # raises
                     call_text("sleepy", {"seconds": 30}),  # times out
                     call_text("silent", {"x": 1}),  # returns None
                     call_text("calculator", {"expression": "6*7"})])  # beyond max_calls_per_turn
    tools = (*load_tools(["calculator"]), *_tools_from(boom, sleepy, silent))
    driver, _ = driver_for(policy, [calls, "done"], tools=tools, tool_timeout_s=0.3, max_calls_per_turn=6,
                           max_total_tokens=4000)
    start = time.perf_counter()
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=2000))
    elapsed = time.perf_counter() - start
    release.set()
    assert elapsed < 3.0  # the 30 s tool was abandoned after 0.3 s
    assert ep.episode.errors == {"bad_arguments": 1, "unknown_tool": 1, "malformed": 1, "raised": 1, "timeout": 1,
                                 "bad_result": 1, "too_many_calls": 1}
    results = [m["content"] for m in ep.episode.messages if m["role"] == "tool"]
    assert len(results) == 7 and all(r.startswith("Error:") for r in results)
    assert "kaput" in results[3] and "0.3 s" in results[4]
    assert ep.episode.turns == 2 and ep.text == "done"  # the model saw the errors and answered
    metrics = episode_metrics([ep])
    assert metrics["agent/tool_error_rate"] == 1.0 and metrics["agent/errors/timeout"] == 1.0
    assert metrics["agent/tool_calls_mean"] == 7.0 and 0 < metrics["agent/tool_token_frac"] < 1


def _tools_from(*fns):
    from rlft.rollout.agent.tools import Tool, tool_schema

    for fn in fns:
        yield Tool(fn.__name__, fn, tool_schema(fn, fn.__name__))


def test_budget_ends_an_episode_at_a_turn_boundary_and_cuts_a_long_turn(tiny):
    _, policy = tiny
    first = call_text("calculator", {"expression": "37 + 48"})
    n_first = len(encode_text(policy.tokenizer, first)) + 1
    # room for turn 1 and a few tokens, not for the observation (13 tokens + the tool schema-free tail)
    driver, engine = driver_for(policy, [first, "The answer is 85."], max_total_tokens=n_first + 5)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    assert ep.completion_ids == engine.sampled[0][0] and ep.loss_mask == [1] * n_first  # nothing inserted
    assert ep.episode.budget_truncated and ep.finish_reason == "length" and len(engine.contexts) == 1
    assert ep.episode.messages[-1]["role"] == "assistant"  # the result it never saw is not in its transcript
    # a budget that ends inside turn 2: turn 2 is cut there (a prefix of a sample), the episode is 'length'
    driver, engine = driver_for(policy, [first, "The answer is 85."], max_total_tokens=n_first + 20)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    assert len(ep.completion_ids) == n_first + 20 and ep.finish_reason == "length"
    assert not ep.episode.budget_truncated and ep.episode.turns == 2
    # max_turns: a call on the last allowed turn is not run
    driver, engine = driver_for(policy, [first, first], max_turns=1)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    assert ep.episode.max_turns_reached and ep.episode.tool_calls == 0 and len(engine.contexts) == 1


def test_tool_output_is_cut_by_tokens_with_a_marker(tiny):
    _, policy = tiny

    def shout(n: int) -> str:
        """Long output.

        Args:
            n: Repeats.
        """
        return "word " * n

    driver, _ = driver_for(policy, [call_text("shout", {"n": 500}), "ok"], tools=tuple(_tools_from(shout)),
                           max_tool_output_tokens=8)
    [ep] = driver.run([PROMPT], SamplingParams(n=1, max_new_tokens=200))
    [result] = [m["content"] for m in ep.episode.messages if m["role"] == "tool"]
    assert result.endswith("more tokens]") and "[output cut:" in result
    assert len(encode_text(policy.tokenizer, result.split("\n[output cut")[0])) <= 8


def test_tools_go_through_the_template_when_it_supports_them(tiny):
    from rlft.rollout.agent.turns import ObservationEncoder

    _, policy = tiny
    schemas = [t.schema for t in load_tools(["calculator"])]
    plain = ObservationEncoder(policy.tokenizer, schemas)  # the tiny ChatML template has no tool support
    assert not plain.native_tools and "<tools>" in plain.render(PROMPT, True)
    tok = policy.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = ("{%- if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{%- endif %}"
                             + saved)
        native = ObservationEncoder(tok, schemas)
        text = native.render(PROMPT, True)
        assert native.native_tools and "TOOLS [" in text and '"calculator"' in text and "<tools>" not in text
    finally:
        tok.chat_template = saved


def test_prompts_are_checked_for_length_with_the_tool_descriptions(tiny):
    from rlft.data.prompts import prompt_example
    from rlft.errors import DataError
    from rlft.rollout.agent import check_prompts_with_tools

    _, policy = tiny
    driver, _ = driver_for(policy, [])
    example = prompt_example(policy.tokenizer, "prompts.jsonl:3", PROMPT, {})
    with_tools = len(driver.encoder.prompt_ids(PROMPT))
    assert with_tools > len(example.prompt_ids) + 50  # the schema block
    check_prompts_with_tools(driver, [example], with_tools, 64)
    with pytest.raises(DataError, match=r"prompts.jsonl:3: .* longer than data.max_prompt_length"):
        check_prompts_with_tools(driver, [example], with_tools - 1, 64)
    driver.engine.max_model_len = with_tools + 64  # a vLLM engine: prompt and episode budget must fit
    check_prompts_with_tools(driver, [example], with_tools, 64)
    with pytest.raises(ConfigError, match=r"agent.max_total_tokens=65 exceeds the vLLM engine's max_model_len"):
        check_prompts_with_tools(driver, [example], with_tools, 65)


def test_bad_tools_and_unsupported_setups_are_clear_errors(tmp_path):
    from rlft.config import load_config

    (tmp_path / "t.py").write_text("def nodoc(x):\n    return x\n\ndef calculator(expression: str) -> str:\n"
                                   '    """Other.\n\n    Args:\n        expression: e.\n    """\n    return ""\n')
    with pytest.raises(ConfigError, match="type hint"):
        load_tools([f"{tmp_path / 't.py'}:nodoc"])
    with pytest.raises(ConfigError, match="unique"):
        load_tools(["calculator", f"{tmp_path / 't.py'}:calculator"])
    with pytest.raises(ConfigError, match="unknown tool"):
        load_tools(["calculater"])
    from rlft.rollout.agent.turns import ObservationEncoder

    class DropsTools:  # a template that renders no 'tool' messages: results could never reach the model
        chat_template = ""
        eos_token_id, all_special_ids = None, []

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages if m["role"] != "tool")

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

    with pytest.raises(ConfigError, match="drops"):
        ObservationEncoder(DropsTools(), [])
    base = {"output_dir": str(tmp_path / "r"), "model": {"path": "x"}, "data": {"train": "x"},
            "rewards": [{"fn": "math"}], "agent": {"tools": ["calculator"]}}
    # Dr. GRPO's constant normaliser is the longest completion: with tools, the episode budget
    assert load_config({**base, "method": "dr_grpo"}).algorithm.loss_constant == 1024
    with pytest.raises(ConfigError, match="online rollouts and in SFT"):
        load_config({**base, "method": "dpo"})
    assert load_config({**base, "method": "sft"}).agent.tools == ["calculator"]  # SFT on tool-use transcripts


CALC_REWARD = '''
def used_calculator(prompt, completion, messages, turns, tool_calls, max_new_tokens, completion_tokens, **row):
    assert messages[0]["role"] in ("user", "system") and turns >= 1
    assert max_new_tokens == 64 and completion_tokens <= 64  # the episode's budget, shared by every turn
    return 1.0 if row["answer"] in completion else 0.1 * min(tool_calls, 1) + 0.01 * (len(completion) % 3)
'''


def test_grpo_with_the_calculator_runs_and_logs_agent_metrics(tiny, tmp_path):
    from rlft.api import train

    path, _ = tiny
    (tmp_path / "reward.py").write_text(CALC_REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)}) + "\n" for a in range(8)))
    summary = train({
        "method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"path": str(path)}, "data": {"train": str(tmp_path / "prompts.jsonl")},
        "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "precision": "fp32"},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 12},
        "rewards": [{"fn": f"{tmp_path / 'reward.py'}:used_calculator"}],
        "agent": {"tools": ["calculator"], "max_turns": 3, "max_total_tokens": 64},
        "logging": {"progress": False, "sample_every": 1, "num_samples": 2},
    })
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns_mean" in r]
    assert len(steps) == 2
    for key in ("agent/tool_calls_mean", "agent/tool_error_rate", "agent/tool_token_frac", "agent/budget_truncated",
                "agent/tool_latency_mean_s", "agent/errors/malformed", "agent/retokenize_drift"):
        assert key in steps[0]
    assert steps[0]["agent/turns_mean"] >= 1
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["transcript"][0]["role"] == "assistant" and s["turns"] >= 1 for s in samples)
    for s in samples:  # turns alternate: sampled, then inserted, ...
        assert [seg["trained"] for seg in s["segments"]] == [k % 2 == 0 for k in range(len(s["segments"]))]
        assert s["segments"][0]["role"] == "assistant" and len(s["segments"]) <= 2 * s["turns"]
