"""Synthetic run directories written by hand (config.yaml, metrics.jsonl, samples.jsonl,
events.jsonl, summary.json), so report and ledger tests need no training."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

# A completion that would run script, break a table or open a tag if it were not escaped.
NASTY = "<script>window.__pwned = 1</script><b>bold?</b> & </pre></td> | done"


def online_config(output_dir: Path, **changes: Any) -> dict[str, Any]:
    cfg = {"method": "grpo", "output_dir": str(output_dir), "seed": 0,
           "model": {"path": "/models/tiny-sft", "device": "cpu"},
           "data": {"train": "prompts.jsonl", "eval": "eval.jsonl"},
           "training": {"learning_rate": 1e-5, "max_steps": 30, "eval_every": 10},
           "rollout": {"group_size": 8, "max_new_tokens": 64, "temperature": 1.0},
           "algorithm": {"kl_coef": 0.04, "clip_high": 0.2},
           "rewards": [{"fn": "math", "weight": 1.0}, {"fn": "format", "weight": 0.2}],
           "logging": {"progress": False}}
    for dotted, value in changes.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def write_run(root: Path, config: dict[str, Any], metrics: list[dict[str, Any]],
              samples: list[dict[str, Any]] = (), events: list[dict[str, Any]] = (),
              summary: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for name, rows in (("metrics", metrics), ("samples", samples), ("events", events)):
        if rows:
            (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (root / "summary.json").write_text(json.dumps(summary))
    return root


def online_metrics(steps: int = 30, reward_slope: float = 0.02, length_growth: float = 0.0) -> list[dict[str, Any]]:
    """GRPO-like records: reward rising by `reward_slope` per step, an eval every 10 steps."""
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": 0.2 + reward_slope * s, "reward/math": 0.15 + reward_slope * s,
               "reward/format": 0.5, "reward/std": 0.3, "reward/infra_error_rate": 0.0,
               "kl": 0.001 * s, "entropy": 1.2 - 0.01 * s, "beta": 0.04,
               "completion/length_mean": 40.0 * (1 + length_growth * s), "completion/truncation_rate": 0.05,
               "completion/repetition_rate": 0.02, "clip/high_frac": 0.01, "clip/low_frac": 0.005,
               "ratio/mean": 1.0, "ratio/max": 1.4, "adv/zero_std_group_frac": 0.25,
               "loss": 0.1 * math.sin(s), "grad_norm": 0.5, "lr": 1e-5, "time/step": 2.0, "tokens_per_s": 160.0}
        if s % 10 == 0:
            row.update({"eval/accuracy": 0.3 + 0.01 * s, "eval/format_compliance": 0.9, "eval/length_mean": 38.0})
        rows.append(row)
    return rows


def online_samples(steps=(10, 20, 30)) -> list[dict[str, Any]]:
    return [{"step": s, "where": f"prompts.jsonl:{s}", "prompt": f"What is {s} + 1?",
             "completion": f"The answer is {s + 1}. " + (NASTY if s == 20 else ""), "reward": 1.0 if s != 20 else None,
             "finish_reason": "stop", "components": {"math": 1.0, "format": 0.5}} for s in steps]


@pytest.fixture
def make_online_run(tmp_path):
    def make(name: str = "grpo-a", events: list[dict[str, Any]] = (), summary: dict[str, Any] | None = None,
             metrics: list[dict[str, Any]] | None = None, **changes: Any) -> Path:
        root = tmp_path / name
        return write_run(root, online_config(root, **changes), metrics or online_metrics(), online_samples(),
                         events, {"status": "completed", "step": 30} if summary is None else summary)

    return make


@pytest.fixture
def sft_run_dir(tmp_path) -> Path:
    root = tmp_path / "sft"
    cfg = {"method": "sft", "output_dir": str(root), "model": {"path": "/models/base"},
           "data": {"train": "sft.jsonl"}, "training": {"learning_rate": 3e-3, "max_steps": 20}}
    metrics = [{"step": s, "loss": 3.0 / s, "lr": 3e-3, "grad_norm": 1.0, "epoch": s / 10, "step_time": 0.5}
               for s in range(1, 21)]
    metrics[9].update({"eval/loss": 0.5, "eval/accuracy": 0.2})
    metrics[19].update({"eval/loss": 0.3, "eval/accuracy": 0.4})
    return write_run(root, cfg, metrics, summary={"status": "completed", "step": 20, "eval/loss": 0.3})
