"""Reading a finished (or running) run directory for reports and comparisons: config.yaml,
metrics.jsonl, samples.jsonl, events.jsonl, summary.json. Only the run directory is read, so a run
copied to another machine can be reported with nothing else."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlft.errors import RlftError


@dataclass
class RunData:
    path: Path
    name: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "running or stopped without a summary"))

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.metrics if isinstance(r.get("step"), int)]
        return max(steps) if steps else self.summary.get("step")

    def last_value(self, key: str) -> float | None:
        """The last finite value of `key` in metrics.jsonl."""
        for record in reversed(self.metrics):
            value = record.get(key)
            if is_number(value):
                return float(value)
        return None

    def wall_time_s(self) -> float | None:
        """summary.json's wall time when recorded, else the sum of per-step times (which leaves out
        evaluation and checkpointing), else None."""
        if is_number(self.summary.get("wall_time_s")):
            return float(self.summary["wall_time_s"])
        for key in ("time/step", "step_time"):
            times = [r[key] for r in self.metrics if is_number(r.get(key))]
            if times:
                return float(sum(times))
        return None

    def numeric_keys(self) -> list[str]:
        """Metric keys with at least one finite number, in first-seen order."""
        seen: dict[str, None] = {}
        for record in self.metrics:
            for key, value in record.items():
                if key != "step" and is_number(value):
                    seen.setdefault(key)
        return list(seen)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # a run killed mid-write leaves a partial last line; anything else is damage to report
            if n == len(lines):
                break
            raise RlftError(f"{path}:{n}: not valid JSON ({exc.msg}); fix or delete that line") from None
    return rows


def load_run(path: str | Path) -> RunData:
    root = Path(path)
    if not root.is_dir():
        raise RlftError(f"run directory not found: {root}")
    config_path, metrics_path = root / "config.yaml", root / "metrics.jsonl"
    if not config_path.exists() and not metrics_path.exists():
        raise RlftError(f"{root} is not a run directory (no config.yaml or metrics.jsonl); give the output_dir "
                        "of a training run")
    config: dict[str, Any] = {}
    try:
        if config_path.exists():
            config = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RlftError(f"{config_path}: not valid YAML: {exc}") from None
    summary: dict[str, Any] = {}
    summary_path = root / "summary.json"
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise RlftError(f"{summary_path}: not valid JSON ({exc.msg})") from None
    return RunData(path=root, name=root.name, config=config, metrics=read_jsonl(metrics_path),
                   samples=read_jsonl(root / "samples.jsonl"), events=read_jsonl(root / "events.jsonl"),
                   summary=summary)


def load_runs(paths: list[str | Path]) -> list[RunData]:
    """Runs named by their folder, with the parent folder added where two share a name."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
    return runs


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
