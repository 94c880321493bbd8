"""agent.schedule=continuous: turns join and leave the hf engine's decode batch as they come
(rollout/continuous.py). A turn's tokens are those `generate` samples for the same stream whenever
it joins; a slow tool call holds up only its own episode; the rounds schedule is unchanged.

Precision: fp32 throughout. Token ids are compared exactly and log-probs to 1e-5: a row computed
beside other rows (other padding, other kernel blocking) may differ in the last bits, and these
seeds and models were checked to sample the same tokens despite it."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from agent_model import SUMS, question
from rlft.rollout.contract import SamplingParams
from rlft.rollout.continuous import TurnRequest
from rlft.rollout.hf import HFEngine, generation_stop_ids
from rlft.rollout.agent.tool_calls import pick_parser
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver

TOL = 1e-5  # fp32 log-probs of a token computed in another batch


def close(a, b) -> bool:
    return a.completion_ids == b.completion_ids and all(abs(x - y) <= TOL for x, y in zip(a.logprobs, b.logprobs))


@pytest.fixture(scope="module")
def calc(calculator_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(calculator_path, dtype=torch.float32),
            AutoTokenizer.from_pretrained(calculator_path))


def engine_for(model, tokenizer, **kw) -> HFEngine:
    return HFEngine(model, tokenizer, generation_stop_ids(model, tokenizer), torch.device("cpu"), seed=0, **kw)


def test_turns_joining_mid_generation_sample_what_generate_samples_alone(calc):
    """Rows join a batch in flight with a shorter and a longer context than its columns (both
    alignments of the KV merge), leave it on a stop token or their own token limit, and each
    turn equals `generate` of its context alone, from the same stream."""
    model, tok = calc
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=24)
    contexts = {"a": list(range(5, 25)), "b": list(range(30, 36)), "c": list(range(40, 90)), "d": list(range(7, 40))}
    limits = {"a": 24, "b": 24, "c": 9, "d": 24}
    engine = engine_for(model, tok)
    batch = engine.continuous(params)
    assert batch is not None and engine._calls == 1
    got = {}
    batch.add([TurnRequest("a", contexts["a"], limits["a"], name="a")])
    finished, busy = batch.step(5)  # "a" is 5 tokens in when the others join
    assert finished == [] and busy and len(batch.tokens[0]) == 5
    batch.add([TurnRequest(key, contexts[key], limits[key], name=key) for key in "bcd"])
    while busy:
        finished, busy = batch.step(3)
        got.update(finished)
    for key, ids in contexts.items():
        alone = engine_for(model, tok)
        alone._calls = 1  # a named stream continues the call the batch claimed
        ref = alone.generate([ids], dataclasses.replace(params, max_new_tokens=limits[key]), streams=[key])[0]
        assert close(got[key], ref), key
        assert got[key].prompt_ids == ids and got[key].finish_reason == ref.finish_reason
    assert len(got["c"].completion_ids) <= 9


def slow_calculator(delays: dict[str, float]):
    """The calculator, sleeping `delays[expression]` seconds (default 0) before it answers."""
    calculator = load_tools(["calculator"])[0]

    def calculate(expression: str) -> str:
        time.sleep(delays.get(expression.replace(" ", ""), 0.0))
        return calculator.fn(expression)

    return dataclasses.replace(calculator, fn=calculate)


def run_driver(calc, schedule: str, delays: dict[str, float], temperature: float = 0.5, engine=None):
    model, tok = calc
    engine = engine or engine_for(model, tok)
    driver = TurnDriver(engine, tok, [slow_calculator(delays)], pick_parser("auto", tok.chat_template),
                        AgentLimits(max_turns=3, max_total_tokens=300), schedule=schedule)
    ended: dict[int, float] = {}
    take = driver._take_turn

    def timed(ep, out, turn, stop=()):  # when each episode's turns end
        calls = take(ep, out, turn, stop)
        ended[ep.index] = time.perf_counter()
        return calls

    driver._take_turn = timed
    prompts = [[{"role": "user", "content": question(a, b)}] for a, b in SUMS]
    start = time.perf_counter()
    out = driver.run(prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=96))
    return out, {i: t - start for i, t in ended.items()}, engine


def test_continuous_episodes_are_the_rounds_episodes(calc):
    """Tool latencies that reorder which turns share a batch change no episode: the same tokens,
    turns, calls and observations as the rounds schedule, and the engine's streams end equal."""
    delays = {f"{a}+{b}": 0.05 * i for i, (a, b) in enumerate(SUMS)}
    rounds, _, r_engine = run_driver(calc, "rounds", delays)
    continuous, _, c_engine = run_driver(calc, "continuous", delays)
    assert sum(c.episode.tool_calls for c in rounds) >= 8  # the model does call the calculator
    for a, b in zip(rounds, continuous):
        assert close(a, b)
        assert a.loss_mask == b.loss_mask and a.episode.messages == b.episode.messages
        assert a.finish_reason == b.finish_reason and a.episode.turns == b.episode.turns
    assert r_engine.state_dict() == c_engine.state_dict()


def test_a_slow_tool_holds_up_only_its_own_episode(calc):
    """One sum's calls take 3 s: under rounds every episode's answer waits for them; under
    continuous the other episodes finish first."""
    a, b = SUMS[0]
    delays = {f"{a}+{b}": 3.0}
    slow = set(range(3))  # the first prompt's 3 episodes
    for schedule in ("rounds", "continuous"):
        out, ended, _ = run_driver(calc, schedule, delays, temperature=0.0)
        assert all(c.episode.tool_calls == 1 and c.episode.turns == 2 for c in out)  # call, then answer
        fast_done = max(t for i, t in ended.items() if i not in slow)
        slow_done = min(t for i, t in ended.items() if i in slow)
        if schedule == "rounds":
            assert fast_done >= 3.0  # the sanity check: rounds do wait
        else:
            assert fast_done < 3.0 <= slow_done


@pytest.mark.slow  # ~8 s (a spawned child); make test keeps test_sampler_process's engine-level test
def test_the_process_sampler_drives_the_same_continuous_batch(calc, tmp_path):
    """rollout.sampler=process: the child's continuous batch, driven over the pipe, gives the
    in-process batch's episodes and stream state."""
    from rlft.rollout.sampler_process import ProcessEngine

    model, tok = calc
    local, _, local_engine = run_driver(calc, "continuous", {})
    model.save_pretrained(tmp_path / "copy")  # the child maps the storages of its own copy
    copy_ = type(model).from_pretrained(tmp_path / "copy", dtype=torch.float32)
    remote_engine = ProcessEngine(engine_for(copy_, tok))
    try:
        remote, _, _ = run_driver(calc, "continuous", {}, engine=remote_engine)
        assert all(close(a, b) for a, b in zip(local, remote))
        assert remote_engine.state_dict() == local_engine.state_dict()
    finally:
        remote_engine.close()


def test_waiting_on_tools_sleeps_until_an_episode_can_go_on():
    """When every episode waits on a tool the driver sleeps until all of one episode's calls are
    ready (not polling, not waking for an episode still waiting on its second call), and a call
    past its time limit counts as ready."""
    from rlft.rollout.agent.tools import PendingCall, Tool, start_call

    def nap(seconds: float) -> str:
        time.sleep(seconds)
        return "ok"

    tool = {"nap": Tool(name="nap", fn=nap, schema={})}
    first = [start_call(tool, "nap", {"seconds": 0.05}), start_call(tool, "nap", {"seconds": 0.6})]
    second = [start_call(tool, "nap", {"seconds": 0.3})]
    start, cpu = time.perf_counter(), time.thread_time()
    PendingCall.wait_any([first, second], timeout_s=10.0)
    waited, spent = time.perf_counter() - start, time.thread_time() - cpu
    assert all(c.ready(10.0) for c in second) and not first[1].ready(10.0)
    assert 0.25 <= waited < 0.55, waited  # woke for `second`, not for first[0] alone
    print(f"waited {waited:.3f} s, CPU {spent * 1e3:.2f} ms")
    assert spent < 0.002, spent  # slept (a 1 ms polling loop took 6 ms of CPU over 0.3 s)
    stuck = [start_call(tool, "nap", {"seconds": 5.0})]
    start = time.perf_counter()
    PendingCall.wait_any([stuck], timeout_s=0.2)
    assert 0.15 <= time.perf_counter() - start < 1.0  # its time limit, not its end
