"""Shared fixtures for the foundation tests: tiny models built once per session, a synthetic chat
SFT dataset with a fixed answer format, a small-config helper, and helpers several test modules
share (the in-process CLI runner, big-batch vs micro-batch gradients, a dense reward, a scripted
engine for multi-turn episodes)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Subprocesses (rlft commands, torchrun ranks, the sampler process) too: with two OpenMP threads on
# a busy 2-core machine torch can stall many-fold (make test took 12:25 without this, 10:36 with it)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tiny models are far too small for intra-op parallelism: on a busy 2-core machine a training
# step took ~2 s with torch's default 2 threads and ~0.03 s with one. Training runs set
# training.num_threads=1 anyway (process-wide), so this only makes timings independent of order.
torch.set_num_threads(1)

# The SFT answer format: a fixed sentence with one number. `format_regex` is what a compliant
# completion must fully match (eval.format_regex).
ANSWER_REGEX = r"The answer is \d+\."

# The tiny models' ChatML template with one extra newline after the generation header: the classic
# "one extra newline before the assistant turn" mismatch between SFT and RL.
CHANGED_TEMPLATE = ("{%- for message in messages %}"
                    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                    "{%- endfor %}"
                    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="session")
def qwen_path(tmp_path_factory) -> Path:
    from rlft.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> Path:
    from rlft.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def calculator_path(tmp_path_factory) -> Path:
    """The tiny model trained to use the calculator (tests/agent_model.py), built once a session."""
    from agent_model import build_calculator_model

    return build_calculator_model(tmp_path_factory.mktemp("calculator") / "model")


# -- multi-turn episodes without a model that can write calls --------------------------------

def call_text(name: str, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine:
    """Turn t of every episode samples `script[t]` (text, encoded once, then end-of-turn); each
    sampled token's log-prob is -(1 + its position) so that a misplaced one shows."""

    def __init__(self, tokenizer, script: list[str], end_turn: bool = True):
        from rlft.models.template import encode_text

        self.tok, self.end_turn = tokenizer, end_turn
        eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
        # a turn is text (encoded the tokenizer's way) or raw ids (any split the model might sample)
        self.turns = [(encode_text(tokenizer, t) if isinstance(t, str) else list(t)) + ([eot] if end_turn else [])
                      for t in script]
        self.contexts: list[list[list[int]]] = []  # per call: the contexts it continued
        self.sampled: list[list[list[int]]] = []  # per call: the ids it returned per row
        self.streams: list = []  # per call: the stream names it was given (None: a new request)

    def generate(self, prompts, params, first_prompt: int = 0, streams=None):
        from rlft.rollout.contract import Completion

        turn = len(self.contexts)
        self.contexts.append([list(p) for p in prompts])
        self.streams.append(streams)
        out = []
        for i, p in enumerate(prompts):
            for _ in range(params.n):
                ids = self.turns[turn][: params.max_new_tokens]
                finish = "stop" if len(ids) == len(self.turns[turn]) and self.end_turn else "length"
                text = self.tok.decode(ids, skip_special_tokens=True)
                for s in params.stop:  # as the HF engine: the text ends before a stop string, the ids do not
                    text = text.split(s)[0]
                out.append(Completion(list(p), ids, text,
                                      [-(1.0 + k) for k in range(len(ids))], finish, i))
        self.sampled.append([c.completion_ids for c in out])
        return out


class SpyEngine:
    """The hf engine, recording what every generate call returned."""

    def __init__(self, engine):
        self.engine, self.samples = engine, []

    def generate(self, prompts, params, first_prompt=0, streams=None):
        out = self.engine.generate(prompts, params, first_prompt, streams)
        self.samples += [(list(c.prompt_ids), list(c.completion_ids)) for c in out]
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def arithmetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Chat rows 'What is a + b?' -> 'The answer is N.' (a, b < 100, so the answer has 1-3 digits
    and rows differ in length)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"The answer is {a + b}."}],
                     "answer": str(a + b)})
    return rows


# A dense reward for online tests: a few steps on a random tiny model visibly move it.
DIGITS_REWARD = '''
def digits(prompt, completion, **row):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''


def take_grads(model) -> dict[str, torch.Tensor]:
    """Copies of the parameters' gradients; the model's are cleared."""
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def big_and_micro_batches(objective, model, examples, norm: float, micro: int = 2):
    """`objective.loss` over all examples at once, then over micro-batches of `micro` with the same
    normaliser (gradients accumulated): losses, summed metrics and gradients of both."""
    from types import SimpleNamespace

    loss_big, m_big = objective.loss(model, examples, norm)
    loss_big.backward()
    big = take_grads(model)
    loss_micro, m_micro = 0.0, {}
    for i in range(0, len(examples), micro):
        loss, m = objective.loss(model, examples[i:i + micro], norm)
        loss.backward()
        loss_micro += float(loss.detach())
        m_micro = {k: m_micro.get(k, 0.0) + v for k, v in m.items()}
    return SimpleNamespace(loss_big=float(loss_big.detach()), metrics_big=m_big, grads_big=big,
                           loss_micro=loss_micro, metrics_micro=m_micro, grads_micro=take_grads(model))


def run_main(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """`rlft ARGS` in this process through the real entry point `rlft.cli.app:main`."""
    from rlft.cli.app import main

    monkeypatch.setattr(sys, "argv", ["rlft", *args])
    monkeypatch.setenv("COLUMNS", "250")
    code = 0
    try:
        main()
    except SystemExit as exc:  # typer exits 0 on success; main() exits 2 on user errors
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def assert_clean_user_error(result: subprocess.CompletedProcess) -> str:
    """Exit code 2, exactly one line starting with 'error:', no traceback. Returns stderr."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    error_lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(error_lines) == 1, output
    return result.stderr


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> dict[str, Path]:
    """256 training rows and 32 held-out rows (different seed) as JSONL."""
    root = tmp_path_factory.mktemp("sft_data")
    return {"train": write_jsonl(root / "train.jsonl", arithmetic_rows(256, seed=1)),
            "eval": write_jsonl(root / "eval.jsonl", arithmetic_rows(32, seed=2))}


def make_config(model_path: Path | str, train: Path | str, output_dir: Path | str, **sections: Any) -> dict[str, Any]:
    """A small SFT config dict: no progress bar, one CPU thread, small batches, short evals.
    Keyword arguments are sections whose keys are merged over these defaults."""
    config: dict[str, Any] = {
        "method": "sft",
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"path": str(model_path), "device": "cpu"},
        "data": {"train": str(train), "max_length": 128},
        "training": {"learning_rate": 1e-3, "batch_size": 4, "epochs": 1, "num_threads": 1,
                     "lr_scheduler": "constant"},
        "logging": {"progress": False},
        "eval": {"max_examples": 8, "max_new_tokens": 12, "batch_size": 32},
    }
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **values}
        else:
            config[name] = values
    return config


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, qwen_path, sft_data):
    """One real SFT run shared by the run-directory, learning, export and template tests:
    40 steps of 16 rows (lr 3e-3, 4 warmup steps, cosine), eval at step 20 and at the end,
    checkpoints at steps 20 and 40. The held-out metrics of the untrained model are measured
    first with the same objective, on the same policy object that is then trained."""
    from types import SimpleNamespace

    from rlft.config import load_config
    from rlft.models.loading import load_policy
    from rlft.training.offline.loop import make_objective, run_offline

    root = tmp_path_factory.mktemp("sft_run")
    config = load_config(make_config(
        qwen_path, sft_data["train"], root / "run",
        data={"eval": str(sft_data["eval"])},
        training={"learning_rate": 3e-3, "batch_size": 16, "epochs": 3, "max_steps": 40,
                  "lr_scheduler": "cosine", "warmup_ratio": 0.1, "eval_every": 20},
        eval={"format_regex": ANSWER_REGEX, "max_examples": 32, "max_new_tokens": 12},
        checkpoint={"every": 20, "keep_last": 2},
    ))
    policy = load_policy(config.model, config.lora)
    initial = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    objective = make_objective(config)
    _, evals, _ = objective.prepare(policy)
    baseline = objective.evaluate(policy, evals)
    summary = run_offline(config, make_objective(config), policy=policy)
    return SimpleNamespace(config=config, policy=policy, baseline=baseline, summary=summary,
                           root=Path(config.output_dir), initial_state=initial)


@pytest.fixture
def no_hub(monkeypatch):
    """The hub at a closed local port (connection refused at once), so these tests behave the same
    on machines with and without network; the once-per-process reachability probe starts fresh."""
    from huggingface_hub import constants

    from rlft.models import hub

    endpoint = "http://127.0.0.1:9"  # the discard port: nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.hub_unreachable.cache_clear()
    yield endpoint
    hub.hub_unreachable.cache_clear()


def interrupt_when_hung(command: list[str], marker: Path, env: dict[str, str], what: str) -> tuple[str, float, int]:
    """Start `command`, send one SIGINT once `marker` exists (the run is then inside a hung call of
    `what`), and return (its output, seconds from the signal to its end, its exit code). A failed test leaves no
    process behind."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, f"the {what} never started hanging"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        return output, time.monotonic() - sent, proc.returncode
    finally:
        if proc.poll() is None:  # a failed test must not leave a hung trainer behind
            proc.kill()
            proc.wait()


# -- processes (from /proc) and shell lines, for tests that start servers and launchers -------------

def process_table() -> dict[int, tuple[int, int]]:
    """Every live process (zombies left out): pid -> (parent pid, process group)."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] not in ("Z", "X"):
            out[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return out


def children_of(pid: int) -> list[int]:
    return [p for p, (parent, _) in process_table().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children...)."""
    table = process_table()
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _) in table.items() if pp == parent]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    return pid in process_table()


def command_lines(body: str) -> list[str]:
    """A shell block's commands: one a line (a trailing backslash continues it), blanks and comments skipped."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out
