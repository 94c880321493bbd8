"""Console output: a progress bar carrying the key numbers of the latest step."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = RichConsole(stderr=True)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


_LABELS = {"reward/mean": "reward", "completion/length_mean": "len", "clip/high_frac": "clip+",
           "eval/accuracy": "eval_acc", "eval/loss": "eval_loss", "eval/format_compliance": "format",
           "grad_norm": "gnorm", "rewards/accuracy": "acc", "eval/rewards/accuracy": "eval_acc"}


def _label(key: str) -> str:
    return _LABELS.get(key, key.split("/")[-1])


class ProgressDisplay:
    def __init__(self, total: int, start: int, keys: list[str], enabled: bool, title: str):
        self.keys = keys
        self.enabled = enabled
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(bar_width=16), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.description}"), console=console, transient=False)
            self._task = self._progress.add_task("", total=total, completed=start)
            self._progress.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._progress is None:
            return
        text = " ".join(f"{_label(k)}={fmt(metrics[k])}" for k in self.keys if k in metrics)
        self._progress.update(self._task, completed=step, description=text)

    def print(self, *args: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args)
        else:
            console.print(*args)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
