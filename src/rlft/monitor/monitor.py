"""The health monitor the training loop calls once per logged step.

    alerts = monitor.observe(record)         # new alerts, each also one line of events.jsonl
    reason = monitor.should_stop_early(record)  # plateau of a held-out metric, or KL too high

An alert is written once when its condition starts to hold, not on every step while it holds; the
detector re-arms when the condition clears, so a second episode is a second event.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlft.config.monitor import EarlyStopSettings, MonitorConfig
from rlft.monitor.detectors import DETECTORS, Alert, History
from rlft.monitor.rundir import append_lines, jsonl_line, write_text_atomic
from rlft.monitor.text_stats import batch_repetition_rate

EVENTS_FILE = "events.jsonl"


class EarlyStopper:
    """Patience over evals of one held-out metric, and a KL ceiling."""

    def __init__(self, settings: EarlyStopSettings):
        self.settings = settings
        self.best: float | None = None
        self.best_step: int | None = None
        self.evals_since_best = 0

    def update(self, record: dict[str, Any]) -> str | None:
        s = self.settings
        kl = _number(record.get(s.kl_metric))
        if s.kl_stop is not None and kl is not None and kl > s.kl_stop:
            return (f"{s.kl_metric} {kl:.4g} at step {record.get('step')} is above monitor.early_stop.kl_stop="
                    f"{s.kl_stop:.4g}")
        value = _number(record.get(s.metric)) if s.metric else None
        if value is None:
            return None
        better = self.best is None or (value > self.best + s.min_delta if s.mode == "max"
                                       else value < self.best - s.min_delta)
        if better:
            self.best, self.best_step, self.evals_since_best = value, record.get("step"), 0
            return None
        self.evals_since_best += 1
        if self.evals_since_best >= s.patience:
            return (f"{s.metric} has not improved by more than {s.min_delta:.4g} for {self.evals_since_best} evals "
                    f"(best {self.best:.4g} at step {self.best_step}, now {value:.4g})")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.evals_since_best = state["best"], state["best_step"], state["evals_since_best"]


class Monitor:
    def __init__(self, settings: MonitorConfig | None = None, run_dir: str | Path | None = None):
        self.settings = settings or MonitorConfig()
        self.events_path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
        self.history = History()
        self.active: set[str] = set()
        self._keys = self.settings.watched_keys()
        self._stopper = EarlyStopper(self.settings.early_stop)

    def completion_metrics(self, texts: list[str]) -> dict[str, float]:
        """Text statistics of a batch of completions, for the loop to log with its metrics."""
        s = self.settings
        return {s.repetition.metric: batch_repetition_rate(texts, s.repetition_ngram, s.repetition_unit)}

    def observe(self, record: dict[str, Any]) -> list[Alert]:
        """Run the enabled detectors on the history including `record`; return the alerts that
        started firing at this record (already written to events.jsonl)."""
        self.history.append({k: v for k, v in record.items() if k in self._keys})
        fired = []
        for name in self.settings.enabled:
            alert = DETECTORS[name](self.history, **self.settings.thresholds(name))
            if alert is None:
                self.active.discard(name)  # re-arm
                continue
            if name in self.active:
                continue
            self.active.add(name)
            alert = replace(alert, action=self.settings.action(name))
            self._write(alert)
            fired.append(alert)
        return fired

    def should_stop_early(self, record: dict[str, Any]) -> str | None:
        """A reason to stop (a plateau of monitor.early_stop.metric, or KL above kl_stop), or None.
        Call once per logged record, like `observe`."""
        return self._stopper.update(record)

    def _write(self, alert: Alert) -> None:
        if self.events_path is None:
            return
        append_lines(self.events_path, [jsonl_line(alert.to_event())], "logging a health event")

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.state_dict(), "active": sorted(self.active),
                "early_stop": self._stopper.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved with a checkpoint; events written after it (by the attempt that
        is being resumed) are dropped, as the loop drops those metrics lines."""
        self.history = History.from_state(state["history"])
        self.active = set(state["active"])
        self._stopper.load_state_dict(state["early_stop"])
        step = self.history.last_step
        if self.events_path is not None and self.events_path.exists():
            lines = [ln for ln in self.events_path.read_text().splitlines()
                     if ln.strip() and json.loads(ln).get("step", 0) <= step]
            write_text_atomic(self.events_path, "".join(ln + "\n" for ln in lines),
                              f"cutting {self.events_path.name} back to step {step}")


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
