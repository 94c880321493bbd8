"""The health monitor inside real training runs: a hackable reward trips the length detector and
`stop` ends the run with a checkpoint; early stopping and `checkpoint.final: best`; a logging
backend fed by a run; and every metric a run logs is one the catalogue knows (so settings naming a
metric are checked against the truth)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlft.api import train
from rlft.config import load_config
from rlft.models.tiny import build_tiny_model
from rlft.monitor.catalogue import metric_names

LONGER_IS_BETTER = '''
def longer(prompt, completion, completion_tokens, max_new_tokens, **row):
    """A reward a policy can hack by talking longer: it pays for length, not for being right."""
    return completion_tokens / max_new_tokens
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("monitored")
    build_tiny_model(root / "model", seed=0)
    (root / "rewards.py").write_text(LONGER_IS_BETTER)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n"
                                                for i in range(16)))
    (root / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i} + 2?", "completion": f"The answer is {i + 2}.", "answer": str(i + 2)})
        + "\n" for i in range(32)))
    return root


@pytest.fixture(scope="module")
def short_answers(root) -> Path:
    """The tiny model after a short SFT: it answers in a few tokens and stops (the baseline a
    length detector compares with; a random model runs to the length limit)."""
    out = root / "sft-short"
    train({"method": "sft", "output_dir": str(out), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "sft.jsonl")},
           "training": {"learning_rate": 3e-3, "batch_size": 8, "epochs": 8, "num_threads": 1},
           "logging": {"progress": False}})
    return out / "final"


def _hack_config(model: Path, out: Path, rewards: Path) -> dict:
    return {"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": str(model)},
            "data": {"train": str(rewards.parent / "prompts.jsonl")},
            "training": {"learning_rate": 2e-2, "max_steps": 20, "num_threads": 1, "lr_scheduler": "constant"},
            "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 32},
            "algorithm": {"kl_coef": 0.0},
            "rewards": [{"fn": f"{rewards}:longer"}],
            "monitor": {"on_alert": {"length_drift": "stop"}, "enabled": ["length_drift"]},
            "logging": {"progress": False}}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_length_hacking_run_is_stopped_by_the_length_detector(root, short_answers):
    run = root / "hack"
    summary = train(_hack_config(short_answers, run, root / "rewards.py"))
    rows = _metrics(run)
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("length_drift:")
    assert len(rows) < 20  # stopped before the planned end
    first, last = rows[0]["completion/length_mean"], rows[-1]["completion/length_mean"]
    assert last > 1.15 * first  # the detector's threshold: 15% over the start
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detector"] for e in events] == ["length_drift"] and events[0]["action"] == "stop"
    assert events[0]["step"] == summary["step"] == rows[-1]["step"]
    assert (run / "checkpoints" / f"step-{summary['step']:08d}" / "COMPLETE").is_file()
    assert not (run / "final").exists()  # a stopped run is not exported as if it were fine


def test_the_cli_exits_non_zero_for_a_stopped_run(root, short_answers, tmp_path, monkeypatch, capsys):
    import yaml

    from conftest import run_main

    cfg = _hack_config(short_answers, tmp_path / "hack-cli", root / "rewards.py")
    (tmp_path / "hack.yaml").write_text(yaml.safe_dump(cfg))
    result = run_main(monkeypatch, capsys, "train", str(tmp_path / "hack.yaml"))
    assert result.returncode != 0
    assert "stopped by the health monitor" in " ".join(result.stderr.split())


def test_early_stop_on_a_plateau_and_final_is_the_best_checkpoint(root):
    run = root / "early"
    cfg = {"method": "sft", "output_dir": str(run), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "sft.jsonl"), "eval": str(root / "sft.jsonl")},
           "training": {"learning_rate": 3e-3, "batch_size": 8, "epochs": 5, "eval_every": 1, "num_threads": 1},
           "eval": {"max_examples": 4, "max_new_tokens": 4},
           # an improvement must beat the best by 100 nats: after the first eval nothing counts
           "monitor": {"early_stop": {"metric": "eval/loss", "mode": "min", "patience": 2, "min_delta": 100.0}},
           "checkpoint": {"keep_best": "eval/loss", "best_mode": "min", "final": "best"},
           "logging": {"progress": False}}
    summary = train(cfg)
    rows = [r for r in _metrics(run) if "eval/loss" in r]
    assert summary["status"] == "completed" and summary["step"] == 3  # eval 1 is best, evals 2-3 do not count
    assert "eval/loss has not improved by more than 100" in summary["early_stop"]
    best = min(rows, key=lambda r: r["eval/loss"])
    record = json.loads((run / "checkpoints" / "best.json").read_text())
    assert record["value"] == best["eval/loss"]
    assert summary["final_from"].startswith(record["checkpoint"])
    exported = load_file(str(run / "final" / "model.safetensors"))
    saved = load_file(str(run / "checkpoints" / record["checkpoint"] / "model" / "model.safetensors"))
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_a_logging_backend_receives_the_runs_metrics(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = root / "tb"
    train({"method": "sft", "output_dir": str(run), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "sft.jsonl")},
           "training": {"learning_rate": 1e-3, "batch_size": 8, "max_steps": 3, "num_threads": 1},
           "logging": {"progress": False, "backends": ["jsonl", "tensorboard"]}})
    events = EventAccumulator(str(next(p.parent for p in run.rglob("events.out.tfevents*")))).Reload()
    losses = [e.value for e in events.Scalars("loss")]
    assert losses == pytest.approx([r["loss"] for r in _metrics(run)], rel=1e-6)


def test_every_logged_metric_is_in_the_catalogue(root):
    """Real runs of each kind: the keys of metrics.jsonl are a subset of what the catalogue lists
    (the names `checkpoint.keep_best` and `monitor.early_stop.metric` are checked against)."""
    for name in ("hack", "early", "tb"):
        run = root / name
        cfg = load_config(run / "config.yaml")
        names, prefixes = metric_names(cfg, [s.component for s in cfg.rewards])
        logged = {k for r in _metrics(run) for k in r}
        unknown = {k for k in logged if k not in names and not k.startswith(prefixes)}
        assert not unknown, (name, unknown)


def test_metric_descriptions_name_metrics_a_run_logs():
    """A description of a renamed or dropped metric would mislead: each names a metric that an online
    run with a KL term (and rollout servers: time/weight_sync) logs."""
    from rlft.monitor.catalogue import METRIC_DESCRIPTIONS

    cfg = load_config({"method": "grpo", "output_dir": "runs/x", "model": {"path": "m"},
                       "data": {"train": "d.jsonl"}, "rewards": [{"fn": "math"}],
                       "rollout": {"engine": "vllm", "servers": ["http://127.0.0.1:8000"]}})
    names, _ = metric_names(cfg, ["math"])
    assert METRIC_DESCRIPTIONS and set(METRIC_DESCRIPTIONS) <= names
    assert "k3" in METRIC_DESCRIPTIONS["policy/approx_kl"]  # tests/algorithms/test_policy_loss.py checks the number
