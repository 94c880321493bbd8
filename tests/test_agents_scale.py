"""Multi-turn episodes beyond one process's training loop: sampling streams that do not depend on
the batch or the rank, agent metrics summed over ranks, two ranks under torchrun, and held-out
evals, eval suites, `rlft eval` and `rlft data screen` running episodes.

The end-to-end tests use a tiny model trained to use the calculator (tests/agent_model.py): greedy
decoding replays a call, the tool's result, and the right answer, so accuracy with tools is 1 and
without them 0 -- an eval that silently stayed single-turn shows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from agent_model import SUMS, prompt_rows
from conftest import run_main
from rlft.rollout.contract import Completion, Episode, SamplingParams
from rlft.rollout.agent.tool_calls import ParsedCall, hermes
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver, episode_counts, episode_metrics

QUESTIONS = ["What is 2 + 3?", "Count to five.", "Say hi.", "Name a colour."]


def calls_on_some_turns(text: str) -> list[ParsedCall]:
    """Stands for a model that sometimes calls the calculator (a random tiny model never writes a
    call): a turn whose text length is not a multiple of 3 calls it."""
    return [ParsedCall("calculator", {"expression": f"{len(text)} * 2"})] if len(text) % 3 else []


calls_on_some_turns.syntax = hermes.syntax  # what the prompt's tool block teaches (a parser's `syntax`)


@pytest.fixture(scope="module")
def random_policy(qwen_path):
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy

    return load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())


def hf_driver(policy, seed: int = 3):
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    engine = HFEngine(policy.model, policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer),
                      policy.device, seed=seed)
    return TurnDriver(engine, policy.tokenizer, load_tools(["calculator"]), calls_on_some_turns,
                      AgentLimits(max_turns=4, max_total_tokens=120))


def test_an_episode_is_the_same_alone_in_a_batch_and_as_a_ranks_share(random_policy):
    """Every turn of episode (prompt i, sample k) draws from a stream named by (i, k, turn) within
    the request its first turn made: the same episode whether prompt i runs alone (first_prompt=i),
    beside the others (whose episodes end after other numbers of turns, so the live episodes of a
    round differ), or as the second half of the prompts (a rank's share). Each run costs the
    engine one call, however many turns it took, so later requests stay in step too."""
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    # stop strings end most turns early ('stop'), so the parser's calls happen
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop=("a", "e"))
    together = hf_driver(random_policy)
    batch = together.run(prompts, params)
    turns = [c.episode.turns for c in batch]
    assert len(set(turns)) >= 2 and max(turns) >= 3, turns  # rounds are shared by changing sets of episodes
    assert together.engine.state_dict()["calls"] == 1
    again = together.run(prompts, params)  # the next request: new streams
    assert [c.completion_ids for c in again] != [c.completion_ids for c in batch]

    def same(alone, expected):
        assert [c.completion_ids for c in alone] == [c.completion_ids for c in expected]
        assert [c.loss_mask for c in alone] == [c.loss_mask for c in expected]
        assert [c.finish_reason for c in alone] == [c.finish_reason for c in expected]
        assert [c.episode.messages for c in alone] == [c.episode.messages for c in expected]
        for a, b in zip(alone, expected):  # float32, other batch shapes: summation-order noise only
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-5)

    for i in range(len(prompts)):
        driver = hf_driver(random_policy)
        same(driver.run(prompts[i:i + 1], params, first_prompt=i), batch[2 * i:2 * i + 2])
        assert driver.engine.state_dict()["calls"] == 1
    share = hf_driver(random_policy)
    same(share.run(prompts[2:], params, first_prompt=2), batch[4:])
    same(share.run(prompts[2:], params, first_prompt=2), again[4:])


def _completion(turns: int, calls: int, errors: dict, latency: list[float], drift: int | None, tokens: int,
                tool_tokens: int, truncated: bool = False, env: list[float] | None = None) -> Completion:
    record = Episode([], turns=turns, tool_calls=calls, errors=errors, tool_tokens=tool_tokens,
                     budget_truncated=truncated, tool_latency_s=latency, retokenize_drift=drift, env_rewards=env,
                     env_done=bool(env and env[-1] > 0), env_tokens=3 * len(env or []))
    return Completion([1], [7] * tokens, "", [0.0] * tokens, "stop", 0, episode=record)


def test_agent_metrics_of_a_split_batch_summed_over_ranks_equal_the_whole_batchs():
    """Issue 25: each rank logged the agent metrics of its own episodes only. The counts add up
    over ranks (the slowest call is a maximum), so a batch split in two gives the whole's metrics."""
    episodes = [_completion(1, 0, {}, [], 0, 10, 0, env=[0.0, 1.0]),
                _completion(3, 2, {"timeout": 1}, [0.5, 2.0], 4, 40, 12, truncated=True),
                _completion(2, 3, {"malformed": 1, "raised": 1}, [0.25], None, 30, 9, env=[0.5]),
                _completion(2, 1, {}, [1.0], 0, 20, 5, env=[0.0, 0.0, 0.0])]

    def summed_with(other):
        def reduce(counts):  # what MetricAccumulator.reduce does over two ranks
            theirs = episode_counts(other)
            return {k: max(v, theirs[k]) if k.endswith("max") else v + theirs[k] for k, v in counts.items()}
        return reduce

    whole = episode_metrics(episodes)
    for rank0, rank1 in ((episodes[:1], episodes[1:]), (episodes[:2], episodes[2:]), ([], episodes)):
        assert episode_metrics(rank0, reduce=summed_with(rank1)) == pytest.approx(whole, rel=1e-12)
    # by hand: 8 turns / 4 episodes; 6 calls / 4; 3 failed of 6 calls; 26 tool tokens of 100;
    # latency (0.5 + 2 + 0.25 + 1) / 4 calls; drift 4 over the 3 checked episodes, 1 of 3 drifted
    assert whole["agent/turns_mean"] == 2.0 and whole["agent/tool_calls_mean"] == 1.5
    assert whole["agent/tool_error_rate"] == 0.5 and whole["agent/tool_token_frac"] == 0.26
    assert whole["agent/tool_latency_mean_s"] == 0.9375 and whole["agent/tool_latency_max_s"] == 2.0
    assert whole["agent/retokenize_drift"] == pytest.approx(4 / 3) and whole["agent/retokenize_drift_frac"] == 1 / 3
    assert whole["agent/budget_truncated"] == 1.0 and whole["agent/errors/malformed"] == 1.0
    # environments, over the 3 episodes that had one: returns 1, 0.5, 0; 6 steps; 2 done, 1 cut
    assert whole["env/return_mean"] == 0.5 and whole["env/steps_mean"] == 2.0 and whole["env/episodes_done"] == 2.0
    assert whole["env/episodes_cut"] == 1.0 and whole["env/inserted_tokens_mean"] == 6.0
    assert episode_metrics([], reduce=lambda counts: counts) == {}


def test_a_later_turns_requests_are_capped_at_what_the_engine_holds():
    """A later turn's episodes share one max_new_tokens (the largest budget left among them): a
    long episode's request is capped at max_model_len (the driver cuts it at its own, smaller,
    budget anyway); a first turn that does not fit is an error, never cut silently."""
    from types import SimpleNamespace

    from rlft.errors import ConfigError
    from rlft.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only the engine's length
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(max_model_len=100)))
    params = SamplingParams(max_new_tokens=30)
    assert engine._token_caps([[1] * 60, [1] * 90], params, later_turn=True) == [30, 10]  # 100 - 90
    with pytest.raises(ConfigError, match="a prompt of 90 tokens plus max_new_tokens=30 exceeds .* max_model_len=100"):
        engine._token_caps([[1] * 60, [1] * 90], params, later_turn=False)
    with pytest.raises(ConfigError, match="max_model_len=100"):  # a context that fills the engine
        engine._token_caps([[1] * 100], params, later_turn=True)


# ---- end to end, with the model that uses the calculator --------------------------------------

@pytest.fixture(scope="module")
def calc(tmp_path_factory, calculator_path) -> Path:
    """A folder with the calculator model (`model/`) and its sums as prompt rows (`sums.jsonl`)."""
    root = tmp_path_factory.mktemp("calc")
    shutil.copytree(calculator_path, root / "model")
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    return root


def agent_config(root: Path, name: str, **sections) -> dict:
    """GRPO with the calculator on the sums, fast settings (the learning rate leaves the model as
    it was: evals after a step still see what it learned)."""
    cfg = {"method": "grpo", "output_dir": str(root / name), "seed": 0,
           "model": {"path": str(root / "model"), "device": "cpu"},
           "data": {"train": str(root / "sums.jsonl")},
           "training": {"learning_rate": 1e-7, "max_steps": 1, "num_threads": 1, "precision": "fp32"},
           "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 80},
           "rewards": [{"fn": "math"}],
           "agent": {"tools": ["calculator"], "max_turns": 3, "max_total_tokens": 160},
           "logging": {"progress": False}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


@pytest.fixture(scope="module")
def trained(calc) -> Path:
    """One step with a held-out eval and an eval suite on the sums, both after the step; the
    turns on the continuous schedule (agent.schedule), the evals' too (test_agents runs rounds)."""
    from rlft.api import train

    suite = {"name": "sums", "data": str(calc / "sums.jsonl"), "rewards": [{"fn": "math"}],
             "sampling": {"max_new_tokens": 80}}
    cfg = agent_config(calc, "run", data={"eval": str(calc / "sums.jsonl")},
                       eval={"max_new_tokens": 80, "suites": [suite]}, training={"eval_every": 1},
                       agent={"schedule": "continuous"})
    assert train(cfg)["status"] == "completed"
    return calc / "run"


def test_held_out_evals_and_suites_during_training_run_episodes(trained):
    """data.eval and eval.suites answer with episodes: the model calls the calculator once and
    answers from its result (accuracy 1; a single-turn answer is the call itself, accuracy 0)."""
    [row] = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    for prefix in ("eval/", "eval/sums/"):
        assert row[f"{prefix}accuracy"] == 1.0, row
        assert row[f"{prefix}agent/tool_calls_mean"] == 1.0 and row[f"{prefix}agent/turns_mean"] == 2.0
        assert row[f"{prefix}agent/tool_error_rate"] == 0.0 and row[f"{prefix}num_prompts"] == len(SUMS)
    samples = [json.loads(line) for line in (trained / "samples.jsonl").read_text().splitlines()]
    suite = [s for s in samples if s.get("suite") == "sums"]
    assert len(suite) == len(SUMS) and all(s["tool_calls"] == 1 and s["correct"] for s in suite)
    tool = [m for m in suite[0]["transcript"] if m["role"] == "tool"]
    assert tool == [{"role": "tool", "name": "calculator", "content": str(sum(SUMS[0]))}]
    # the agent's metrics are metrics the run logs: a setting may name them (checkpoint.keep_best ...)
    from rlft.config import load_config
    from rlft.errors import ConfigError
    from rlft.monitor.catalogue import check_metric_setting

    cfg = load_config(yaml.safe_load((trained / "config.yaml").read_text()))
    assert cfg.agent.schedule == "continuous"
    for name in ("eval/agent/tool_error_rate", "agent/tool_calls_mean", "eval/sums/agent/turns_mean"):
        check_metric_setting("checkpoint.keep_best", name, cfg, ["math"])
    with pytest.raises(ConfigError, match="not a metric"):
        check_metric_setting("checkpoint.keep_best", "agent/tool_calls_mean", cfg.model_copy(update={"agent": None}),
                             ["math"])


def test_rlft_eval_of_a_run_uses_its_agent_section(trained, calc, monkeypatch, capsys):
    data = str(calc / "sums.jsonl")
    result = run_main(monkeypatch, capsys, "eval", str(trained), "--data", data)
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads((trained / "evals" / "sums.json").read_text())
    assert saved["metrics"]["eval/accuracy"] == 1.0 and saved["metrics"]["eval/agent/tool_calls_mean"] == 1.0
    assert saved["settings"]["agent"]["tools"] == ["calculator"]
    # without the agent section the answer is the first turn alone: a call, not a number
    result = run_main(monkeypatch, capsys, "eval", str(trained), "agent=null", "--data", data)
    assert result.returncode == 0, result.stdout + result.stderr
    single = json.loads((trained / "evals" / "sums-2.json").read_text())["metrics"]
    assert single["eval/accuracy"] == 0.0 and not any("agent/" in k for k in single)
    # no --data: the run's eval suites, as episodes
    result = run_main(monkeypatch, capsys, "eval", str(trained))
    assert result.returncode == 0, result.stdout + result.stderr
    suites = json.loads((trained / "evals" / "suites.json").read_text())["metrics"]
    assert suites["eval/sums/accuracy"] == 1.0 and suites["eval/sums/agent/tool_calls_mean"] == 1.0


def test_rlft_data_screen_samples_episodes(calc, tmp_path, monkeypatch, capsys):
    """Near-greedy episodes solve every sum (all too easy); the same prompts answered single-turn
    solve none (all too hard)."""
    config = tmp_path / "screen.yaml"
    config.write_text(yaml.safe_dump(agent_config(calc, "screen-run", rollout={"temperature": 0.1})))
    out = tmp_path / "kept.jsonl"
    result = run_main(monkeypatch, capsys, "data", "screen", str(config), "--samples", "2", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kept 0, too easy {len(SUMS)} (> 0.9), too hard 0" in result.stdout
    assert "episodes: 2.00 turns and 1.00 tool calls per episode, tool error rate 0.00" in result.stdout
    result = run_main(monkeypatch, capsys, "data", "screen", str(config), "agent=null", "--samples", "2",
                      "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kept 0, too easy 0 (> 0.9), too hard {len(SUMS)}" in result.stdout and "episodes:" not in result.stdout
    # preference pairs hold single-turn answers: an agent config is refused before the model loads
    result = run_main(monkeypatch, capsys, "data", "pairs", str(config), "--out", str(tmp_path / "pairs.jsonl"))
    assert result.returncode == 2 and "agent=null" in result.stderr and "Traceback" not in result.stderr


CALC_REWARD = '''
def used_calculator(prompt, completion, tool_calls, **row):
    return 0.5 * min(tool_calls, 1) + sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''


@pytest.mark.slow  # make test stays under 10 min; run with -m slow (make test-slow)
def test_two_ranks_run_the_episodes_one_process_runs(calc, tmp_path):
    """GRPO with the calculator on two ranks (torchrun, gloo). With the replay engine of
    dist_driver.py (completions, calls included, depend only on the stream names) the two ranks
    train what one process trains -- weights to float32 noise, the same agent metrics each step,
    which are the whole step's (summed over ranks), not rank 0's share. With the real HF engine
    on the calculator model, each rank's episodes are sampled from the trained weights: the
    trainer's log-probs of the sampled tokens, observations in between, equal the engine's."""
    from safetensors.torch import load_file
    from test_distributed import DRIVER, ENV, in_process

    (tmp_path / "reward.py").write_text(CALC_REWARD)

    def config(name: str, steps: int, learning_rate: float = 1e-3) -> Path:
        cfg = agent_config(calc, name, rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 80},
                           training={"learning_rate": learning_rate, "adam_eps": 1e-6, "lr_scheduler": "constant",
                                     "dist_timeout_s": 60, "max_steps": steps},
                           rewards=[{"fn": f"{tmp_path / 'reward.py'}:used_calculator"}])
        cfg["output_dir"] = str(tmp_path / name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    replay2, real2 = config("replay-2", 3), config("real-2", 2, learning_rate=1e-5)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          DRIVER, "replay-calls", str(replay2), f"real:{real2}"],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    assert in_process(config("replay-1", 3), replay=True, tool_calls=True)["status"] == "completed"

    w2, w1 = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("replay-2", "replay-1"))
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) <= 1e-5
    rows2, rows1 = (_metric_rows(tmp_path / run) for run in ("replay-2", "replay-1"))
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == [1, 2, 3]
    keys = [k for k in rows1[0] if k.startswith("agent/") and "latency" not in k]
    assert "agent/tool_calls_mean" in keys and "agent/errors/unknown_tool" in keys
    for r2, r1 in zip(rows2, rows1):
        assert {k: r2[k] for k in keys} == pytest.approx({k: r1[k] for k in keys}, rel=1e-12)
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5, abs=1e-7)
    assert all(r["agent/turns_mean"] > 1.2 and r["agent/tool_calls_mean"] > 0.2 for r in rows1)

    real = _metric_rows(tmp_path / "real-2")
    assert [r["step"] for r in real] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in real), [r["rollout/logprob_diff_max"] for r in real]
    assert all(r["agent/tool_calls_mean"] > 0.5 and r["agent/tool_token_frac"] > 0 for r in real)


def _metric_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~20 s; make test keeps test_environments' stopped-and-resumed episode run
def test_an_agent_run_killed_after_a_checkpoint_resumes_bitwise(calc, tmp_path):
    """Episodes sampled at temperature 1 (calls, tool results, the engine's call counter): a run
    SIGKILLed right after its step-1 checkpoint and resumed ends where the uninterrupted run ends,
    bit for bit, with the same metrics and samples (tool latencies aside: wall-clock)."""
    from rlft.api import train
    from safetensors.torch import load_file
    from test_resume import run_cli

    def config(name: str) -> Path:
        cfg = agent_config(calc, name, training={"max_steps": 2, "learning_rate": 1e-4},
                           checkpoint={"every": 1}, logging={"sample_every": 1, "num_samples": 2})
        cfg["output_dir"] = str(tmp_path / name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    assert train(config("whole"))["status"] == "completed"
    killed = run_cli("train", str(config("killed")), env={"RLFT_FAULT": "ckpt-done@1"})
    assert killed.returncode != 0 and (tmp_path / "killed" / "checkpoints" / "step-00000001").is_dir()
    resumed = run_cli("train", str(tmp_path / "killed.yaml"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]

    def rows(run: str) -> list[dict]:
        return [{k: v for k, v in r.items() if not any(t in k for t in ("time", "tokens_per_s", "latency"))}
                for r in _metric_rows(tmp_path / run)]

    a, b = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("whole", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows("whole") == rows("killed") and [r["step"] for r in rows("whole")] == [1, 2]
    assert all(r["agent/tool_calls_mean"] > 0.5 for r in rows("whole"))
    assert (tmp_path / "whole" / "samples.jsonl").read_text() == (tmp_path / "killed" / "samples.jsonl").read_text()


@pytest.mark.slow  # vLLM start-up; make test runs the driver on vLLM (test_vllm_engine.py), this the whole loop
def test_grpo_with_tools_on_the_vllm_engine_stays_on_policy(calc, tmp_path):
    """Two GRPO steps whose episodes are sampled by vLLM: the engine's log-probs of the model's own
    tokens equal the trainer's on the masked episode (fp32 rounding), the calculator is called
    and read, and the update moves the weights."""
    from rlft.api import train
    from safetensors.torch import load_file

    cfg = agent_config(calc, "vllm", rollout={"engine": "vllm"}, training={"max_steps": 2, "learning_rate": 1e-4})
    cfg["output_dir"] = str(tmp_path / "vllm")
    assert train(cfg)["status"] == "completed"
    rows = _metric_rows(tmp_path / "vllm")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    assert all(r["agent/tool_calls_mean"] > 0.5 and r["agent/tool_token_frac"] > 0 for r in rows), rows
    before = load_file(str(calc / "model" / "model.safetensors"))
    after = load_file(str(tmp_path / "vllm" / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)
