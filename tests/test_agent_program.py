"""Your own agent program over the OpenAI-compatible endpoint (issue 42): `agent.program`.

The programs below call the tiny Qwen2 policy through `openai.AsyncOpenAI` as any agent would.
What is trained must be exactly what was sampled: a spy engine records every sample, and each one
must appear, in order, as a run of trained (mask 1) ids in the episode's training sequences; a
harness that rewrites the history (drops part of an assistant turn, as reasoning is dropped
between turns) splits the episode into sequences, each of them exact, and counts the break.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from conftest import SpyEngine  # noqa: E402

from rlft.config import AgentConfig, LoraConfig, ModelConfig  # noqa: E402
from rlft.models.loading import load_policy  # noqa: E402
from rlft.rollout.agent.build import agent_driver  # noqa: E402
from rlft.rollout.contract import SamplingParams  # noqa: E402
from rlft.rollout.engines import build_engine  # noqa: E402

PROGRAMS = '''
import asyncio, json

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}


def digits(text):
    return sum(c.isdigit() for c in text) / max(len(text), 1)


async def with_tool(client, row):
    """Ask with a calculator offered; run any call it makes; ask for the answer."""
    msgs = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC])
    m = r.choices[0].message
    msgs.append(m.model_dump(exclude_none=True))
    for call in m.tool_calls or []:
        try:
            value = str(eval(json.loads(call.function.arguments).get("expression", ""), {}))
        except Exception as exc:
            value = f"error: {exc}"
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": value})
    msgs.append({"role": "user", "content": "The answer, digits only."})
    r = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC])
    return digits(r.choices[0].message.content or "")


async def streams_with_tool(client, row):
    """with_tool over streamed replies, put back together from their chunks as streaming clients do
    (content deltas, tool calls by index, the usage chunk)."""
    async def ask(msgs):
        stream = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC], stream=True,
                                                      stream_options={"include_usage": True})
        content, calls, usage, finish = "", {}, 0, None
        async for chunk in stream:
            usage += chunk.usage.completion_tokens if chunk.usage else 0
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        return content, [calls[i] for i in sorted(calls)], usage, finish

    msgs = list(row["messages"])
    content, calls, used, finish = await ask(msgs)
    msgs.append({"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})})
    for call in calls:
        value = str(eval(json.loads(call["function"]["arguments"])["expression"], {}))
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": value})
    answer, _, used_too, _ = await ask(msgs)
    return {"calls": float(len(calls)), "tool_finish": float(finish == "tool_calls"),
            "correct": float(answer.strip() == "44"), "usage": float(used + used_too)}


async def strips_history(client, row):
    """Re-renders its history: keeps only the first 3 characters of the model's first turn."""
    msgs = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=msgs)
    msgs.append({"role": "assistant", "content": (r.choices[0].message.content or "")[:3]})
    msgs.append({"role": "user", "content": "Again."})
    await client.chat.completions.create(model="policy", messages=msgs)
    return {"correct": 1.0, "calls": 2.0}


async def raises(client, row):
    await client.chat.completions.create(model="policy", messages=row["messages"])
    raise RuntimeError("the agent's own bug")


async def hangs(client, row):
    await asyncio.sleep(30)


async def never_calls(client, row):
    return 1.0


async def refused(client, row):
    """Requests the endpoint refuses, each with a 400 naming what to change."""
    base = dict(model="policy", messages=row["messages"])
    out = {}
    for name, extra in (("n", {"n": 2}), ("temperature", {"temperature": 0.3}),
                        ("logit_bias", {"extra_body": {"logit_bias": {"1": 5}}})):
        try:
            await client.chat.completions.create(**base, **extra)
            out[name] = "accepted"
        except Exception as exc:
            out[name] = f"{getattr(exc, 'status_code', '?')} {exc}"
    from pathlib import Path
    Path(__file__).with_name("refused.json").write_text(json.dumps(out))
    return 0.0
'''


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "agents.py"
    path.write_text(PROGRAMS)
    return path


@pytest.fixture(scope="module")
def policy(qwen_path):
    return load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())


def drive(policy, programs, name, n=2, **agent):
    spy = SpyEngine(build_engine(policy, 0, "hf"))
    cfg = AgentConfig(program=f"{programs}:{name}", max_total_tokens=96, **agent)
    driver = agent_driver(cfg, spy, policy.tokenizer, [], 4096, 0)
    try:
        prompts = [[{"role": "user", "content": "What is 12 + 30?"}], [{"role": "user", "content": "Say 7."}]]
        out = driver.run(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=12))
    finally:
        driver.close()
    torch.set_num_threads(1)
    return out, spy.samples


def trained_runs(completion) -> list[list[int]]:
    """The completion's runs of trained (mask 1) ids."""
    runs, cur = [], []
    for token, m in zip(completion.completion_ids, completion.mask):
        if m:
            cur.append(token)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_a_tool_using_program_trains_exactly_the_sampled_ids(policy, programs):
    """Two calls an episode (the second after the assistant turn is sent back with its tool calls
    and a tool result): one sequence an episode whose trained runs are the two samples, in order."""
    out, samples = drive(policy, programs, "with_tool")
    assert len(out) == 4 and len(samples) == 8
    by_prompt = {}
    for prompt, ids in samples:
        by_prompt.setdefault(tuple(prompt), []).append(ids)
    for c in out:
        assert c.episode.prefix_breaks == 0 and c.episode.turns == 2 and c.episode.program_ok
        first, second = trained_runs(c)[0], trained_runs(c)[-1]
        assert first in by_prompt[tuple(c.prompt_ids)]  # the first call's sample, as sampled
        # the second call's prompt is this sequence up to its last trained run: the sample follows it
        context = c.prompt_ids + c.completion_ids[:len(c.completion_ids) - len(second)]
        assert second in by_prompt[tuple(context)]
        assert c.episode.program_reward == pytest.approx(c.episode.program_reward)


def test_a_streaming_program_gets_its_replies_as_chunks_and_trains_one_exact_sequence(policy, programs):
    """stream=True: the reply (sampled whole first) comes as OpenAI's chunks, a tool call included;
    sent back as the client put it together, it continues the same sequence (nothing re-encoded)."""
    from conftest import ScriptedEngine, call_text

    from rlft.rollout.agent.program import program_driver
    from rlft.rollout.agent.tool_calls import pick_parser

    engine = ScriptedEngine(policy.tokenizer, ["", call_text("calculator", {"expression": "20 + 24"}), "44"])
    engine.max_model_len = None
    cfg = AgentConfig(program=f"{programs}:streams_with_tool", max_total_tokens=400)
    driver = program_driver(cfg, engine, policy.tokenizer, pick_parser(cfg.parser, policy.tokenizer.chat_template))
    try:
        [c] = driver.run([[{"role": "user", "content": "What is 20 + 24?"}]],
                         SamplingParams(n=1, temperature=1.0, max_new_tokens=120))
    finally:
        driver.close()
    assert c.episode.program_ok and c.episode.turns == 2 and c.episode.prefix_breaks == 0
    first, second = engine.sampled[1][0], engine.sampled[2][0]
    assert c.episode.program_reward == {"calls": 1.0, "tool_finish": 1.0, "correct": 1.0,
                                        "usage": float(len(first) + len(second))}
    assert trained_runs(c) == [first, second]  # the two samples as sampled, the tool result between them masked


def test_a_streamed_text_completion_is_its_text_then_its_finish_then_the_usage():
    from rlft.rollout.agent.endpoint import stream_chunks

    reply = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "rlft-policy",
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
             "choices": [{"index": 0, "text": "42", "finish_reason": "stop", "logprobs": None}]}
    chunks = stream_chunks(reply, include_usage=True)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["42", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, "stop"]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    assert len(stream_chunks(reply, include_usage=False)) == 2


def test_a_harness_that_rewrites_history_splits_the_episode_into_exact_sequences(policy, programs):
    out, samples = drive(policy, programs, "strips_history")
    assert len(out) == 8  # 2 prompts x 2 samples, 2 sequences each
    assert {c.episode.prefix_breaks for c in out} == {1}
    # the trainer sees each episode once in its group's baseline: its second sequence points at its first
    from rlft.training.online.loop import _to_leader

    assert _to_leader(out, torch.device("cpu")).tolist() == [0, -1] * 4
    sampled = {(tuple(p), tuple(ids)) for p, ids in samples}
    for c in out:
        assert c.mask == [1] * len(c.completion_ids)  # each sequence: one call, all of it trained
        assert (tuple(c.prompt_ids), tuple(c.completion_ids)) in sampled  # never re-tokenised
    assert out[0].episode is out[1].episode  # one episode, one reward
    from rlft.rewards.rules import program

    row = {"program_reward": out[0].episode.program_reward, "program_ok": True}
    assert program(key="correct")("q", "", **row) == 1.0


@pytest.mark.parametrize("name, error", [("raises", "program_raised"), ("hangs", "program_timeout"),
                                         ("never_calls", "program_no_call")])
def test_a_failing_program_ends_its_episode_with_nothing_trained(policy, programs, name, error):
    out, _ = drive(policy, programs, name, episode_timeout_s=1.0)
    for c in out:
        assert c.episode.errors == {error: 1} and c.episode.program_ok is False
        assert sum(c.mask) == 0
    from rlft.rollout.agent.turns import episode_metrics

    metrics = episode_metrics(out)
    assert metrics[f"agent/errors/{error}"] == 4.0 and metrics["agent/program_error_rate"] == 1.0
    # the other kinds are logged as 0 (the detector sums each kind's last steps: a stale count would mislead)
    assert all(metrics[f"agent/errors/{kind}"] == 0.0
               for kind in ("program_raised", "program_timeout", "program_no_call") if kind != error)


def test_a_program_that_fails_every_episode_is_said_at_step_2_once(tmp_path, qwen_path, programs, capsys,
                                                                   monkeypatch):
    """The health monitor's tool_errors detector sees a program's failed episodes as it sees failed
    tool calls: one warning at step 2 naming the kind and its fix, and one event."""
    from rlft.api import train

    monkeypatch.setenv("COLUMNS", "250")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n"
                                                    for i in range(8)))
    run = tmp_path / "run"
    summary = train({"method": "grpo", "output_dir": str(run), "seed": 0,
                     "model": {"path": str(qwen_path), "device": "cpu"},
                     "data": {"train": str(tmp_path / "prompts.jsonl")},
                     "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1},
                     "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8},
                     "agent": {"program": f"{programs}:raises", "max_total_tokens": 64},
                     "rewards": [{"fn": "program"}], "logging": {"progress": False}})
    torch.set_num_threads(1)
    assert summary["status"] == "completed"
    out = capsys.readouterr()
    said = " ".join((out.out + out.err).split())
    line = ("warn: tool_errors at step 2: every agent program episode failed in each of the last 2 steps "
            "(program_raised: 8), so nothing is trained")
    assert said.count("warn: tool_errors") == 1 and line in said, said
    assert "the log has each traceback" in said.split(line, 1)[1]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e.get("detector") == "tool_errors"]
    assert event["values"]["agent/program_error_rate"] == 1.0 and event["values"]["errors/program_raised"] == 8


def test_the_endpoint_refuses_what_it_cannot_record_with_a_400_naming_it(policy, programs):
    drive(policy, programs, "refused", n=1)
    results = json.loads(programs.with_name("refused.json").read_text())
    for name in ("n", "temperature", "logit_bias"):
        assert results[name].startswith("400") and name in results[name], results


def test_the_endpoint_needs_the_runs_key(policy, programs):
    from rlft.rollout.agent.endpoint import PolicyEndpoint
    from rlft.rollout.agent.tool_calls import hermes

    endpoint = PolicyEndpoint(policy.tokenizer, hermes, None)
    try:
        endpoint.open_episode("e0.0", 32)
        url = endpoint.base_url("e0.0") + "/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(url, json=body, timeout=10).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        assert endpoint.port and endpoint.base_url("x").startswith("http://127.0.0.1:")
    finally:
        endpoint.close()


def test_a_program_run_learns(tmp_path, qwen_path, programs):
    """GRPO on `with_tool` (reward: the share of digits in the final answer, the tool offered on
    every call): the train reward rises over 8 steps and the held-out reward ends above the
    starting model's, evaluated through the same program."""
    from rlft.api import train
    from rlft.config import EvalConfig, RewardSpec
    from rlft.eval.run import evaluate_model

    for split, lo in (("prompts", 0), ("heldout", 100)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n"
                                                         for i in range(lo, lo + 16)))
    agent = {"program": f"{programs}:with_tool", "max_total_tokens": 400}
    cfg = {"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
           "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": str(tmp_path / "prompts.jsonl"), "eval": str(tmp_path / "heldout.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 8, "num_threads": 1, "lr_scheduler": "constant",
                        "precision": "fp32", "eval_every": 100},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12},
           "eval": {"temperature": 1.0, "num_samples": 2, "max_new_tokens": 12},
           "agent": agent, "rewards": [{"fn": "program"}], "logging": {"progress": False}}
    summary = train(cfg)
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert summary["status"] == "completed" and len(rows) == 8
    assert all(r["agent/turns_mean"] == 2 for r in rows)
    first = sum(r["reward/mean"] for r in rows[:2]) / 2
    last = sum(r["reward/mean"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)
    before = evaluate_model(qwen_path, str(tmp_path / "heldout.jsonl"), [RewardSpec(fn="program")],
                            EvalConfig(temperature=1.0, num_samples=2, max_new_tokens=12),
                            agent=AgentConfig(**agent)).metrics
    torch.set_num_threads(1)
    assert summary["eval/reward_mean"] > before["eval/reward_mean"] + 0.05, (before, summary)


def test_async_program_runs_train(tmp_path, qwen_path, programs):
    """async k=1 with an evaluation after every step: the loop's evaluation and the sampler thread's
    next batch share the program driver (one batch at a time: each owns the endpoint's settings and
    episode names), so every training step still sees its own 8 episodes, one prefix break each."""
    from rlft.api import train

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n"
                                                    for i in range(8)))
    summary = train({"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
                     "model": {"path": str(qwen_path), "device": "cpu"},
                     "data": {"train": str(tmp_path / "prompts.jsonl"), "eval": str(tmp_path / "prompts.jsonl")},
                     "eval": {"max_new_tokens": 8, "max_examples": 4},
                     "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1, "eval_every": 1},
                     "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "async_steps": 1},
                     "algorithm": {"rollout_correction": "tis"},
                     "agent": {"program": f"{programs}:strips_history", "max_total_tokens": 64},
                     "rewards": [{"fn": "program", "args": {"key": "correct"}}], "logging": {"progress": False}})
    torch.set_num_threads(1)
    assert summary["status"] == "completed" and summary["step"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 3 and all(r.get("agent/prefix_breaks") == 8 and r["agent/program_error_rate"] == 0
                                        for r in train_rows)  # 2 prompts x 4, one break each
    assert sum("eval/reward_mean" in r for r in rows) == 3 and summary["eval/agent/program_error_rate"] == 0
    assert Path(tmp_path / "run" / "final").is_dir()


def test_the_shipped_example_program_runs_an_episode(policy):
    """examples/agent_program.py, as the agents guide configures it: one batch of episodes."""
    root = Path(__file__).resolve().parents[1]
    spy = SpyEngine(build_engine(policy, 0, "hf"))
    driver = agent_driver(AgentConfig(program=f"{root / 'examples' / 'agent_program.py'}:run", max_total_tokens=256),
                          spy, policy.tokenizer, [], 4096, 0)
    try:
        out = driver.run([[{"role": "user", "content": "What is 94 + 85?"}]],
                         SamplingParams(n=2, temperature=1.0, max_new_tokens=16))
    finally:
        driver.close()
    torch.set_num_threads(1)
    assert len(out) == 2 and all(c.episode.program_ok and 1 <= c.episode.turns <= 3 for c in out)
    assert all(set(c.episode.program_reward) == {"correct", "tool_used"} for c in out)
    assert all(c.episode.prefix_breaks == 0 for c in out)


def test_a_program_run_resumed_ends_bitwise_as_one_left_alone(tmp_path, qwen_path, programs):
    """A tool-using program's run stopped after 2 steps and resumed to 4 (the endpoint's calls are
    sampled on streams named by the batch, so they repeat) equals the 4-step run: weights, metrics.
    What is computed from the sampler's log-probs agrees to 1e-6 (kl, rollout/ratio_mean) or stays
    at float noise (rollout/logprob_diff_*), not bitwise: the engine batches the calls as they arrive, and a batch's
    shape moves those log-probs in the 7th digit (the sampled tokens are the streams', and the loss
    uses the trainer's)."""
    from safetensors.torch import load_file

    from rlft.api import resume, train

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n"
                                                    for i in range(8)))

    def cfg(name, steps):
        return {"method": "grpo", "output_dir": str(tmp_path / name), "seed": 0,
                "model": {"path": str(qwen_path), "device": "cpu"},
                "data": {"train": str(tmp_path / "prompts.jsonl")},
                "training": {"learning_rate": 1e-2, "max_steps": steps, "num_threads": 1, "precision": "fp32",
                             "lr_scheduler": "constant"},
                "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
                "agent": {"program": f"{programs}:with_tool", "max_total_tokens": 200},
                "rewards": [{"fn": "program"}], "checkpoint": {"every": 1}, "logging": {"progress": False}}

    assert train(cfg("alone", 4))["status"] == "completed"
    assert train(cfg("resumed", 2))["step"] == 2
    assert resume(tmp_path / "resumed", ["training.max_steps=4"])["step"] == 4
    torch.set_num_threads(1)
    a, b = (load_file(str(tmp_path / name / "final" / "model.safetensors")) for name in ("alone", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def rows(name, sampler_lp):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not any(t in k for t in ("time", "_per_s", "latency"))
                 and (k in ("kl", "rollout/ratio_mean") or "logprob_diff" in k) == sampler_lp} for x in lines]

    assert rows("alone", False) == rows("resumed", False)
    for x, y in zip(rows("alone", True), rows("resumed", True)):
        assert all(x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9) for k in ("kl", "rollout/ratio_mean") if k in x)
        assert all(x[k] < 1e-5 and y[k] < 1e-5 for k in x if "logprob_diff" in k)
    assert all(r["agent/turns_mean"] == 2 for r in rows("alone", False) if "reward/mean" in r)


def test_an_entry_a_program_reward_only_logs_cannot_count_answers_correct(programs, tmp_path, qwen_path):
    """`log_others` entries (a verifiers 0.4 taskset's scores) are logged, not reward parts: naming one as
    eval.correct_component is refused before the run, with the config that works."""
    from rlft.config import Config
    from rlft.errors import ConfigError
    from rlft.monitor.catalogue import preflight

    base = {"method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path)},
            "data": {"train": "t.jsonl", "eval": "e.jsonl"}, "agent": {"program": f"{programs}:strips_history"}}
    total = {"fn": "program", "name": "rubric", "args": {"key": "reward", "log_others": True}}
    with pytest.raises(ConfigError, match="'rubric' only logs 'correct' beside its value"):
        preflight(Config(**base, rewards=[total], eval={"correct_component": "rubric/correct"}))
    preflight(Config(**base, rewards=[total, {"fn": "program", "name": "correct", "weight": 0,
                                              "args": {"key": "correct"}}], eval={"correct_component": "correct"}))
