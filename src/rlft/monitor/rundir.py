"""The run directory: resolved config, metrics.jsonl, samples.jsonl, summary.json, checkpoints/,
final/ -- everything needed to resume or report a run with nothing else."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlft.config import Config, dump_config, load_config

# Settings that may differ when an existing run directory is continued.
MAY_CHANGE = {"training.max_steps", "training.epochs", "checkpoint", "logging", "training.num_threads",
              "training.eval_every", "output_dir"}


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def samples_path(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    def create(self, config: Config) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        dump_config(config, self.config_path)

    def config_changes(self, config: Config) -> list[str]:
        """Dotted fields where `config` differs from the saved config.yaml, besides those a
        continued run may change (MAY_CHANGE)."""
        # re-validated, so fields added by a newer rlft compare as their defaults
        saved = load_config(self.config_path).model_dump(mode="json")
        diffs = _flat_diff(saved, config.model_dump(mode="json"))
        return [k for k in diffs if not any(k == p or k.startswith(p + ".") for p in MAY_CHANGE)]

    def log_metrics(self, record: dict[str, Any]) -> None:
        _append_jsonl(self.metrics_path, record)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            _append_jsonl(self.samples_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def truncate_logs(self, step: int) -> None:
        """On resume, drop log lines written after the checkpoint we resume from, so the resumed
        run's logs read exactly like an uninterrupted run's."""
        for path in (self.metrics_path, self.samples_path):
            if not path.exists():
                continue
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= step]
            path.write_text("".join(ln + "\n" for ln in keep))

    def update_summary(self, values: dict[str, Any]) -> dict[str, Any]:
        summary = json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
        summary.update(values)
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_clean(summary), indent=2))
        tmp.replace(self.summary_path)
        return summary


def _flat_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _flat_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(_clean(record)) + "\n")
