"""The live-tensor tracker on hand-computed cases, and the planner against the peak it measures in
real rlft training runs on the tiny model (SFT, GRPO, LoRA GRPO), each in fp32 and in bf16-mixed.

Every run pins `training.precision` (the planner is told the same): `auto` would be bf16-mixed on a
CPU with AMX / AVX512-BF16 and fp32 elsewhere, and the two hold different tensors. The runs are
tiny (two steps of a ~1M-parameter model) because bf16 is slow on CPUs without bf16 units."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlft.api import train
from rlft.monitor.memory import LiveTensorTracker, track_phase
from rlft.plan.memory import PlanInput, plan_memory

TOLERANCE = 0.25


def test_tracker_counts_live_storages_by_hand():
    with LiveTensorTracker() as tracker:
        a = torch.zeros(1000)  # 4000 B
        b = torch.zeros(2000)  # + 8000 B
        assert tracker.current_bytes == 12000
        del a
        assert tracker.current_bytes == 8000
        c = b * 2  # + 8000 B: the peak
        view = c[:10]  # a view shares its storage: nothing new
        assert tracker.current_bytes == tracker.peak_bytes == 16000
        del b, c
        assert tracker.current_bytes == 8000  # the 10-element view keeps all of c's storage alive
        del view
        assert tracker.current_bytes == 0

        x = torch.ones(8, 16, requires_grad=True)  # 512 B
        w = torch.ones(16, 32, requires_grad=True)  # 2048 B
        with tracker.phase("step"):
            y = x @ w  # 1024 B, kept by square's backward
            loss = y.square().sum()  # square's output (1024 B) is freed once summed; loss 4 B
            assert tracker.current_bytes == 512 + 2048 + 1024 + 4
            del y
            loss.backward()  # frees the graph (y), adds x.grad 512 B and w.grad 2048 B
        assert tracker.current_bytes == 512 + 2048 + 4 + 512 + 2048
        assert tracker.phase_peaks["step"] >= 512 + 2048 + 1024 + 1024 + 4


def test_tracker_sees_memory_freed_only_by_the_autograd_graph():
    x = torch.randn(1000, requires_grad=True)
    with LiveTensorTracker() as tracker:
        y = x.exp()  # exp keeps its output for backward
        total = y.sum()
        base = tracker.current_bytes
        del y  # still held by the graph
        assert tracker.current_bytes == base
        total.backward()  # the graph is freed; x.grad (4000 B) is made
        assert tracker.current_bytes == base - 4000 + 4000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Rows of one token length each, so the planner's worst-case lengths are the run's lengths."""
    root = tmp_path_factory.mktemp("plan_measured")
    rng = random.Random(0)
    with (root / "sft.jsonl").open("w") as f:
        for _ in range(32):  # a, b in 50..99: every sum has 3 digits, every row the same length
            a, b = rng.randint(50, 99), rng.randint(50, 99)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"The answer is {a + b}."}]}) + "\n")
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(1, 10):  # digits are single tokens: equal prompt lengths
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    (root / "rewards.py").write_text("def digits(prompt, completion, **row):\n"
                                     "    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)\n")
    return root


def _measure(config: dict) -> tuple[int, dict[str, int]]:
    import rlft.training.offline.loop as offline
    import rlft.training.online.loop as online
    from rlft.rollout.hf import HFEngine

    tracker = LiveTensorTracker()
    patched = [(HFEngine, "generate", track_phase(tracker, HFEngine, "generate", "rollout")),
               (online, "policy_update", track_phase(tracker, online, "policy_update", "update")),
               (offline, "_train_step", track_phase(tracker, offline, "_train_step", "update"))]
    try:
        with tracker:
            summary = train(config)
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    assert summary["status"] == "completed" and summary["step"] == 2
    return tracker.peak_bytes, tracker.phase_peaks


def _check(plan, measured: int, phases: dict[str, int]) -> None:
    error = plan.total / measured - 1
    assert abs(error) < TOLERANCE, (f"planned {plan.total / 2**20:.2f} MiB vs measured {measured / 2**20:.2f} MiB "
                                    f"({error:+.0%}); phases measured {phases}\n{plan.table()}")
    assert plan.peak_phase == max(phases, key=phases.get)  # the same phase is the peak


# the bf16-mixed cases are tests of bf16 behaviour: they run in `make test-bf16` on every machine
PRECISIONS = pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.bf16)])


@PRECISIONS
def test_plan_matches_measured_sft_peak(qwen_path, data, tmp_path, precision):
    from rlft.config import ModelConfig
    from rlft.data.readers import read_rows
    from rlft.data.sft_examples import make_sft_encoder
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import end_of_turn_ids

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    encode = make_sft_encoder(tok, end_of_turn_ids(tok), max_length=128)
    examples = [encode(r) for r in read_rows(str(data / "sft.jsonl"))]
    assert len({len(e.input_ids) for e in examples}) == 1
    seq_len, targets = len(examples[0].input_ids), sum(examples[0].target_mask)
    config = {"method": "sft", "output_dir": str(tmp_path / "sft"), "model": {"path": str(qwen_path), "device": "cpu"},
              "data": {"train": str(data / "sft.jsonl"), "max_length": 128},
              "training": {"learning_rate": 1e-3, "batch_size": 16, "max_steps": 2, "num_threads": 1,
                           "precision": precision},
              "logging": {"progress": False}}
    measured, phases = _measure(config)
    from transformers import AutoConfig

    plan = plan_memory(AutoConfig.from_pretrained(qwen_path), PlanInput(
        method="sft", precision=precision, param_dtype="fp32", device_type="cpu", micro_batch_size=16, batch_size=16,
        seq_len=seq_len, completion_len=targets))
    _check(plan, measured, phases)


@PRECISIONS
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_plan_matches_measured_grpo_peak(qwen_path, data, tmp_path, lora, precision):
    from transformers import AutoConfig

    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    lengths = {len(encode_prompt(tok, [{"role": "user", "content": f"Count to {i}."}])) for i in range(1, 10)}
    assert len(lengths) == 1
    new_tokens = 16
    config = {"method": "grpo", "output_dir": str(tmp_path / "grpo"), "seed": 0,
              "model": {"path": str(qwen_path), "device": "cpu"}, "lora": {"enabled": lora},
              "data": {"train": str(data / "prompts.jsonl")},
              "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "precision": precision},
              "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": new_tokens},
              "rewards": [{"fn": f"{data / 'rewards.py'}:digits"}], "logging": {"progress": False}}
    measured, phases = _measure(config)
    plan = plan_memory(AutoConfig.from_pretrained(qwen_path), PlanInput(
        method="online", lora=lora, precision=precision, param_dtype="fp32", device_type="cpu",
        micro_batch_size=32, batch_size=32, seq_len=lengths.pop() + new_tokens, completion_len=new_tokens,
        group_size=8, prompts_per_step=4, reference=True,  # grpo's default kl_coef 0.04 > 0
        shared_prefix="auto"))  # the default training.shared_prefix
    _check(plan, measured, phases)
