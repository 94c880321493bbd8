"""Non-finite guard: a step with an inf/NaN loss or gradient is skipped (parameters, optimizer,
scheduler and step counter unchanged), counted and warned about; K in a row stop the run with a
checkpoint and a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from rlft.config import load_config
from rlft.errors import TrainingHalted
from rlft.models.loading import load_policy
from rlft.models.tiny import build_tiny_model
from rlft.training.offline.loop import run_offline
from rlft.training.session import open_run, session_for


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    build_tiny_model(root / "model", seed=0)
    with (root / "sft.jsonl").open("w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": f"What is {i} + 1?", "completion": f"The answer is {i + 1}."}) + "\n")
    return root


def config(root, name, **training):
    return load_config({
        "method": "sft", "output_dir": str(root / name), "model": {"path": str(root / "model")},
        "data": {"train": str(root / "sft.jsonl")}, "logging": {"progress": False},
        "training": {"learning_rate": 1e-3, "batch_size": 4, "num_threads": 1, **training},
    })


def poison(policy, calls_to_poison: set[int]):
    """Make the gradient of one weight infinite on the given backward calls (1-based)."""
    param = next(p for n, p in policy.model.named_parameters() if "q_proj.weight" in n)
    count = {"n": 0}

    def hook(grad):
        count["n"] += 1
        return grad + float("inf") if count["n"] in calls_to_poison else grad

    param.register_hook(hook)
    return count


def test_skipped_update_leaves_parameters_optimizer_and_scheduler_unchanged(root):
    cfg = config(root, "unit")
    with open_run(cfg) as run:
        session = session_for(cfg, run, load_policy(cfg.model, cfg.lora))
        session.start(10, [], "test")
        params = session.params
        for p in params:
            p.grad = torch.ones_like(p)
        assert session.optimizer_step(1.0)[0]  # one good step so the optimizer has state
        before = [p.detach().clone() for p in params]
        opt_before = {k: v.clone() for k, v in session.optimizer.state[params[0]].items()}
        sched_before = session.scheduler.state_dict()
        for p in params:
            p.grad = torch.full_like(p, float("nan"))
        applied, grad_norm = session.optimizer_step(1.0)
        assert not applied and not torch.isfinite(torch.tensor(grad_norm))
        assert all(torch.equal(a, b) for a, b in zip(before, params))
        assert all(torch.equal(opt_before[k], session.optimizer.state[params[0]][k]) for k in opt_before)
        assert session.scheduler.state_dict() == sched_before
        assert session.nonfinite_total == 1 and all(p.grad is None for p in params)
        session.close_display()


def test_isolated_bad_steps_are_skipped_counted_and_training_goes_on(root, capsys):
    cfg = config(root, "skip", epochs=1)  # 32 rows / 4 = 8 batches
    policy = load_policy(cfg.model, cfg.lora)
    poison(policy, {3, 6})
    summary = run_offline(cfg, policy=policy)
    rows = [json.loads(line) for line in (root / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["nonfinite_skipped"] == 2
    assert [r["step"] for r in rows] == list(range(1, 7))  # 8 batches, 2 skipped: 6 updates
    assert rows[-1]["nonfinite_skipped"] == 2
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())
    assert capsys.readouterr().err.count("non-finite") == 2


def test_consecutive_bad_steps_stop_with_a_checkpoint(root):
    cfg = config(root, "stop", epochs=1, max_consecutive_nonfinite=3)
    policy = load_policy(cfg.model, cfg.lora)
    poison(policy, {3, 4, 5})
    with pytest.raises(TrainingHalted, match="3 consecutive steps had a non-finite") as exc:
        run_offline(cfg, policy=policy)
    # the last good state is step 2 (batches 1-2 trained, 3-5 skipped)
    assert "step-00000002" in str(exc.value)
    assert (root / "stop" / "checkpoints" / "step-00000002" / "COMPLETE").exists()
    # summary.json says it too (it used to be left unwritten: the console was the only record)
    summary = json.loads((root / "stop" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 2 and "non-finite" in summary["error"]
