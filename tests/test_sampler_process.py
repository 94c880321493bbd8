"""The async sampler's hf engine in a child process (rollout.sampler=process): the same
completions, metrics and weights as the sampler thread's engine, exact resume, a child that dies
or raises stops the run by name with a checkpoint, and no child outlives a run or its parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlft.api import train
from rlft.errors import TrainingHalted
from test_async import grpo, root  # noqa: F401  (the module's fixture)
from test_resume import assert_same_run, metrics

STEPS = 3


def run(base: Path, name: str, sampler: str, steps: int = STEPS, **sections) -> Path:
    if not (base / name / "final").exists():
        cfg = grpo(base, name, 1, steps=steps, **sections)
        cfg["rollout"]["sampler"] = sampler
        assert train(cfg)["status"] == "completed"
    assert multiprocessing.active_children() == []  # the sampler process is gone after the run
    return base / name


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by a parent that is itself gone) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_engine_in_a_process_returns_what_the_engine_in_process_returns(tmp_path):
    """Same weights, seed and call sequence: the same completions (new requests, named streams of
    later turns, an isolated evaluation stream), the same stream state; a child's exception comes
    back by name and a killed child is named with its signal, the streams still readable."""
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import disable_dropout, load_policy
    from rlft.models.tiny import build_tiny_model
    from rlft.rollout import build_engine
    from rlft.rollout.contract import SamplingParams
    from rlft.rollout.sampler_process import ProcessEngine, SamplerProcessFailed
    from rlft.training.online.rollouts import sampler_copy

    build_tiny_model(tmp_path / "model", seed=0)
    policy = load_policy(ModelConfig(path=str(tmp_path / "model")), LoraConfig())
    disable_dropout(policy.model)
    copy_ = sampler_copy(policy)
    local, remote = build_engine(policy, 3), ProcessEngine(build_engine(copy_, 3))
    try:
        params, prompts = SamplingParams(n=3, max_new_tokens=8), [[1, 2, 3], [4, 5]]
        runs = []
        for engine in (local, remote):
            out = [engine.generate(prompts, params), engine.generate(prompts, params, streams=["a", "b"])]
            with engine.isolated_rng(7):
                out.append(engine.generate(prompts, params))
            out += [engine.state_dict(), engine.generate(prompts, params, first_prompt=2), engine.state_dict()]
            runs.append(out)
        assert runs[0] == runs[1] and runs[1][-1]["calls"] == 2
        with torch.no_grad():  # a weight load: the parent writes the shared storages, then the push
            for p in copy_.model.parameters():
                p.mul_(0.5)
            for p in policy.model.parameters():
                p.mul_(0.5)
        remote.sync_weights()
        assert local.generate(prompts, params) == remote.generate(prompts, params)
        with pytest.raises(SamplerProcessFailed, match=r"raised IndexError: .* \(in generate\)"):
            remote.generate([[10 ** 6]], params)
        os.kill(remote.pid, signal.SIGKILL)
        with pytest.raises(SamplerProcessFailed, match=r"killed by SIGKILL \(exit code -9\) during a weight push"):
            remote.sync_weights()
        remote.load_state_dict(runs[0][3])  # a dead child's streams stay the proxy's (a checkpoint reads them)
        assert remote.state_dict() == runs[0][3]
    finally:
        remote.close()
    assert not alive(remote.pid)


def test_k1_with_the_process_sampler_equals_the_thread_sampler_bitwise(root):  # noqa: F811
    thread, process = run(root, "sampler-thread", "thread"), run(root, "sampler-process", "process")
    assert_same_run(thread, process)  # final weights, per-step metrics (timings aside), samples


@pytest.mark.slow  # make test under 10 min: the engine-level test covers named streams; run with make test-slow
def test_agent_episodes_with_the_process_sampler_equal_the_thread_samplers(root):  # noqa: F811
    """The turn driver (tool calls, parsing) stays on the sampler thread, each turn's tokens come
    from the child: the same episodes, metrics and weights."""
    agent = {"agent": {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 32}}
    thread = run(root, "agent-thread", "thread", steps=2, **agent)
    process = run(root, "agent-process", "process", steps=2, **agent)
    assert_same_run(thread, process)
    assert all("agent/turns_mean" in r for r in metrics(process))


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: three runs
def test_stopping_and_continuing_with_the_process_sampler_is_exact(root):  # noqa: F811
    reference = run(root, "sampler-process", "process")
    cfg = grpo(root, "sampler-process-stops", 1, steps=STEPS)
    cfg["rollout"]["sampler"] = "process"
    assert train(cfg, ["training.max_steps=2"])["status"] == "completed"
    assert train(cfg)["status"] == "completed"
    assert_same_run(reference, root / "sampler-process-stops")
    assert multiprocessing.active_children() == []


@pytest.mark.slow  # make test names a killed child at the engine level (the first test here)
def test_a_killed_sampler_process_stops_the_run_with_a_checkpoint_and_resumes_identically(root, monkeypatch):  # noqa: F811
    """SIGKILL to the child before its 3rd batch: the loop trains what was sampled, stops naming
    the signal, saves the last completed step; the resumed run (a new child) equals the reference."""
    from rlft.rollout.sampler_process import ProcessEngine

    reference = run(root, "sampler-process", "process")
    real = ProcessEngine.generate

    def killed(self, prompts, params, first_prompt=0, streams=None):
        if self._state["stream"] == "train" and self._state["calls"] == 2:
            os.kill(self.pid, signal.SIGKILL)
        return real(self, prompts, params, first_prompt, streams)

    monkeypatch.setattr(ProcessEngine, "generate", killed)
    cfg = grpo(root, "sampler-process-killed", 1, steps=STEPS)
    cfg["rollout"]["sampler"] = "process"
    with pytest.raises(TrainingHalted) as exc:
        train(cfg)
    message = str(exc.value)
    assert "sampler failed while making batch 3" in message and "killed by SIGKILL" in message, message
    assert "last completed step (2)" in message
    assert multiprocessing.active_children() == []
    monkeypatch.setattr(ProcessEngine, "generate", real)
    train(cfg)
    assert_same_run(reference, root / "sampler-process-killed")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().split(")")[-1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


@pytest.mark.slow  # ~30 s: a CLI run and its resume
def test_ctrl_c_to_the_process_group_stops_at_a_step_saves_and_leaves_no_child(root):  # noqa: F811
    """A terminal's Ctrl-C reaches the whole foreground group: the child ignores it (and left the
    group), the trainer stops at the step's end and saves with the child's streams, the child
    exits with the run, and the continued run equals the reference."""
    from test_resume import RLFT, run_cli, write_config

    reference = run(root, "sampler-process", "process")
    name = "sampler-process-ctrl-c"
    cfg = grpo(root, name, 1, steps=STEPS, checkpoint={"every": 100})
    cfg["rollout"]["sampler"] = "process"
    path = write_config(cfg)
    proc = subprocess.Popen([RLFT, "train", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    rows = root / name / "metrics.jsonl"
    while not rows.exists() or not rows.read_text().strip():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    sampler = children(proc.pid)
    assert sampler  # the sampler process, started before the first step
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err.decode()[-2000:]
    time.sleep(1)
    assert not any(alive(pid) for pid in sampler)
    resumed = run_cli("train", "--resume", str(root / name), "checkpoint.every=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, root / name)


CHILD_OF_A_KILLED_PARENT = """
import sys, time
from rlft.config import LoraConfig, ModelConfig
from rlft.models.loading import load_policy
from rlft.rollout import build_engine
from rlft.rollout.sampler_process import ProcessEngine
engine = ProcessEngine(build_engine(load_policy(ModelConfig(path=sys.argv[1]), LoraConfig()), 0))
print(engine.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # make test under 10 min: the engine-level test covers named streams; run with make test-slow
def test_the_sampler_process_exits_when_its_parent_is_killed(root):  # noqa: F811
    """No orphan: the parent SIGKILLed (no close, no atexit), the child notices and exits."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF_A_KILLED_PARENT, str(root / "model")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(child)
